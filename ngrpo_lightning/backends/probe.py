"""Measured once per machine and shape: which of two ways to compute the same product is faster.

A machine-dependent choice (oneDNN-packed weights) is timed on the run's own shapes when the run is built, the answer
kept in a JSON file per machine (``$NGRPO_CACHE/backend/``, default ``~/.cache/ngrpo-lightning/backend/``), a machine
being its processor's name, the kernels torch may use (CPU capability, ``ONEDNN_MAX_CPU_ISA``,
``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``), the thread count and torch's version.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ngrpo_lightning.config import cache_dir


def processor_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_signature() -> dict:
    """What decides a CPU measurement's outcome on this machine."""
    return {
        "processor": processor_name(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", ""),
        "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


class Measurements:
    """The measured answers of one machine, read from and written to its JSON file."""

    def __init__(self, folder: Path | None = None):
        signature = machine_signature()
        digest = hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]
        self.path = (folder or cache_dir() / "backend") / f"cpu-{digest}.json"
        self.signature = signature
        try:
            self.answers = json.loads(self.path.read_text()).get("answers", {})
        except (OSError, ValueError):
            self.answers = {}
        self.measured = 0  # answers measured (not read) by this process

    @classmethod
    def recorded(cls, answers: dict) -> Measurements:
        """Answers a run recorded (its checkpoint's): used as they are, never saved; a missing key is measured."""
        self = cls.__new__(cls)
        self.path, self.signature, self.answers, self.measured = None, machine_signature(), dict(answers), 0
        return self

    def get(self, key: str, measure: Callable[[], dict]) -> dict:
        """The answer for ``key``: read, or measured now and saved."""
        if key not in self.answers:
            self.answers[key] = measure()
            self.measured += 1
            self.save()
        return self.answers[key]

    def save(self) -> None:
        if self.path is None:  # recorded answers belong to their run
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"machine": self.signature, "answers": self.answers}, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError:  # a read-only cache: measure again next time
            pass


def median_seconds(fn: Callable[[], object], budget_s: float = 0.15, least: int = 3, most: int = 200) -> float:
    """Median wall time of ``fn()`` over as many calls as fit ``budget_s`` (after one warm-up call)."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < most and (len(times) < least or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def faster(a: Callable[[], object], b: Callable[[], object], rounds: int = 2, budget_s: float = 0.04) -> dict:
    """Times ``a`` and ``b`` alternately (``rounds`` each, the best median kept): ``{"a_s", "b_s"}``."""
    best_a = best_b = float("inf")
    for _ in range(rounds):
        best_a = min(best_a, median_seconds(a, budget_s))
        best_b = min(best_b, median_seconds(b, budget_s))
    return {"a_s": best_a, "b_s": best_b}
