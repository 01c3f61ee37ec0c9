"""benchmarks/main_job_memory.py: the whole `ngrpo train` command measured as a user runs it."""

import os
import sys
from pathlib import Path

import pytest
from conftest import TINY_JOB

if not Path("/proc/self/status").exists():
    pytest.skip("reads the kernel's peak RSS from /proc (Linux)", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import main_job_memory as mjm  # noqa: E402


def test_the_kernel_high_water_mark_of_a_live_process():
    assert mjm.high_water_mark(os.getpid()) > 50 * 2**20  # this test process, torch imported
    assert mjm.high_water_mark(2**22 + 12345) == 0  # no such process


def test_a_short_run_is_measured_whole(monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    result = mjm.measure([o for o in TINY_JOB if not o.startswith("logger.")], steps=2)
    assert len(result["steps_s"]) == 2 and result["step_s"] > 0
    assert result["main_peak_bytes"] > 100 * 2**20  # the trainer's process: torch and a model loaded
    assert result["tree_peak_bytes"] > 100 * 2**20  # sampled: at least the trainer's process once
    assert "Trained 2 steps" in result["console"]
