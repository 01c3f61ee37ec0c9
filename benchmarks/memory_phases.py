"""Where a step's memory goes: the peak RSS of each phase of a training step, read in the process
that trains (``harness.py profile``).

Around each phase (the rollout, the reference log-probs, the update and, inside it, the optimizer
step) the process's peak-RSS mark is reset (Linux: ``/proc/self/clear_refs``) and read back
(``VmHWM``) at the phase's end, so each phase gets its own high-water mark. A phase's peak includes
what earlier phases left resident (freed blocks stay in the process); ``trim`` hands freed heap
memory back (``malloc_trim``) before each phase, so its peak is what the phase needs on top of the
memory alive when it starts. :class:`Milestones` adds the resident memory at fixed points and the
bytes the run's tensors hold, which the RSS is compared with.
"""

from __future__ import annotations

import contextlib
import ctypes
from unittest import mock

import lightning as L
import torch
from common import peak_rss_bytes, reset_peak, rss_bytes

PHASES = ("rollout", "reference", "update", "optimizer")


class PhaseMeter:
    """Per-phase peak RSS; a phase inside another (the optimizer step in the update) counts
    towards both, and the process's peak is the largest mark ever read."""

    def __init__(self, trim: bool = False):
        self.trim = ctypes.CDLL("libc.so.6").malloc_trim if trim else None
        self.stack: list[list] = []  # [name, running peak]
        self.peaks: dict[str, list[int]] = {name: [] for name in PHASES}
        self.process_peak = peak_rss_bytes()

    def fold(self) -> None:
        """Count the peak since the last reset towards the process and every open phase."""
        mark = peak_rss_bytes()
        self.process_peak = max(self.process_peak, mark)
        for frame in self.stack:
            frame[1] = max(frame[1], mark)

    @contextlib.contextmanager
    def phase(self, name: str):
        self.fold()
        if self.trim is not None:  # freed heap memory handed back: the mark then starts at live memory
            self.trim(0)
        reset_peak()
        self.stack.append([name, rss_bytes()])
        try:
            yield
        finally:
            self.fold()
            self.peaks[name].append(self.stack.pop()[1])
            reset_peak()

    def wrap(self, owner, attribute: str, name: str):
        """``mock.patch.object`` that runs ``owner.attribute`` inside phase ``name``."""
        original = getattr(owner, attribute)

        def metered(*args, **kwargs):
            with self.phase(name):
                return original(*args, **kwargs)

        return mock.patch.object(owner, attribute, metered)

    @contextlib.contextmanager
    def around_training(self):
        """The phases marked on the classes that run them, while the block trains."""
        from ngrpo_lightning.rollout.hf_engine import HFEngine
        from ngrpo_lightning.training.module import RLModule

        with (
            self.wrap(HFEngine, "generate", "rollout"),
            self.wrap(RLModule, "prepare", "reference"),
            self.wrap(RLModule, "optimize", "update"),
            self.wrap(torch.optim.AdamW, "step", "optimizer"),
        ):
            yield self


def tensor_bytes(tensors) -> int:
    """Bytes held by the tensors' storages, each counted once."""
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


class Milestones(L.Callback):
    """Resident memory at fixed points and the bytes the run's tensors hold."""

    def __init__(self):
        self.points: dict[str, int] = {"imports": rss_bytes()}
        self.after_step: list[int] = []
        self.tensors: dict[str, int] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.points["models loaded"] = rss_bytes()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after_step.append(rss_bytes())

    def on_train_end(self, trainer, pl_module) -> None:
        policy, reference = pl_module.policy, pl_module.reference
        state = trainer.optimizers[0].state.values()
        self.tensors = {
            "policy weights": tensor_bytes(policy.parameters()),
            "reference weights": tensor_bytes(reference.parameters()) if reference else 0,
            "gradients": tensor_bytes(p.grad for p in policy.parameters()),
            "AdamW state": tensor_bytes(v for s in state for v in s.values()),
        }
