"""benchmarks/memory_phases.py (harness.py profile): each phase gets its own peak-RSS mark, and a
phase inside another counts towards both (Linux: /proc/self/clear_refs)."""

import sys
from pathlib import Path

import pytest
import torch

if not Path("/proc/self/clear_refs").exists():
    pytest.skip("needs Linux's /proc/self/clear_refs", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import memory_phases as smp  # noqa: E402
from common import rss_bytes  # noqa: E402

MIB = 2**20


def touch(mib: int) -> torch.Tensor:
    return torch.ones(mib * MIB // 4)  # written, so resident


def test_phase_peaks_are_separate_and_nested_phases_count_in_both():
    meter = smp.PhaseMeter(trim=True)
    with meter.phase("update"):
        start = rss_bytes()
        big = touch(300)
        del big
        with meter.phase("optimizer"):
            small = touch(50)
            del small
    with meter.phase("rollout"):
        pass
    update, optimizer, rollout = meter.peaks["update"][0], meter.peaks["optimizer"][0], meter.peaks["rollout"][0]
    assert update >= start + 290 * MIB
    assert update >= optimizer  # the nested phase's mark is folded into the outer one
    assert optimizer < update - 200 * MIB  # reset on entry: the 300 MiB freed before it is not its own
    assert rollout < update - 200 * MIB  # trimmed before it: the freed 300 MiB left the process
    assert meter.process_peak >= update
