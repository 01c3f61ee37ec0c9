"""The named phases of a training step, timed as the device runs them and visible to profilers.

A GPU runs behind the host: the host's clock at the end of a phase says when its last kernel was
queued, not when it ran, and the next phase's first wait for the device (a ``.item()``, a copy
to the host) then absorbs the rest. So a phase on a GPU ends with the host waiting for the
device: ``time/logprobs_s`` is the reference pass, not the time to queue it. A step waits for
the device at its end anyway (its metrics are read), and the update's first micro-batch waits
right after the log-probs (its share of the tokens), so the wait costs the step nothing.

Each phase is also a range ``ngrpo/<name>`` for profilers: in a ``torch.profiler`` trace (or
Lightning's ``+trainer.profiler=pytorch``) the kernels of the rollout, the reward, the log-probs
and the update are under their names, and Lightning's ``+trainer.profiler=simple`` reports each
phase's mean time beside its own hooks. ``benchmarks/large_shapes.py --profile`` reads them.
"""

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
    """Time the block as phase ``name`` (waiting at its end for ``device``'s queued work where
    the device runs asynchronously) under the profiler range ``ngrpo/<name>``; ``profiler``: a
    Lightning profiler to report it to as well. Yields a :class:`PhaseTime` set on exit."""
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
