"""The named phases of a training step, timed as the device runs them and visible to profilers.

A GPU runs behind the host, so a phase on a GPU ends with the host waiting for the device: its time is the work, not the
queueing. The step waits there anyway (its metrics are read), so this costs nothing. Each phase is also a profiler range
``ngrpo/<name>``: in a ``torch.profiler`` trace (or ``+trainer.profiler=pytorch``) the kernels are under their phase,
and ``+trainer.profiler=simple`` reports each phase's mean time (``benchmarks/harness.py profile`` reads them)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

PREFIX = "ngrpo/"
PHASES = ("rollout", "reward", "logprobs", "update")  # a training step's, in order


@dataclass
class PhaseTime:
    seconds: float = 0.0


@contextmanager
def phase(name: str, device: torch.device | None = None, profiler=None) -> Iterator[PhaseTime]:
    """Time the block as phase ``name`` (waiting at its end for ``device``'s queued work) under the profiler range
    ``ngrpo/<name>``, also reported to a Lightning ``profiler``. Yields a :class:`PhaseTime` set on exit."""
    timed = PhaseTime()
    with ExitStack() as stack:
        if profiler is not None:
            stack.enter_context(profiler.profile(PREFIX + name))
        stack.enter_context(torch.profiler.record_function(PREFIX + name))
        t0 = time.perf_counter()
        yield timed
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        timed.seconds = time.perf_counter() - t0
