"""benchmarks/main_job_memory.py: the whole `ngrpo train` command measured as a user runs it."""

import os
import subprocess
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
    assert len(result["steps_s"]) == 2 and result["step_s"] in result["steps_s"][1:]
    assert 0 < sum(result["steps_s"]) < result["wall_s"]  # the steps happen inside the whole command
    # the trainer's peak is above that of a process that only imports torch and Lightning (it also
    # loads a model and trains it), and the sampled tree saw the trainer at least once
    code = "import os, torch, lightning, sys; sys.path.insert(0, sys.argv[1]); import main_job_memory as m; "
    code += "print(m.high_water_mark(os.getpid()))"
    benchmarks = str(Path(__file__).parents[1] / "benchmarks")
    imports_only = int(subprocess.run([sys.executable, "-c", code, benchmarks], capture_output=True, text=True).stdout)
    assert result["main_peak_bytes"] > imports_only > 50 * 2**20
    assert result["tree_peak_bytes"] > 100 * 2**20
    assert result["tree_peak_bytes"] <= result["main_peak_bytes"] * 4  # a few answer-checking workers, not a leak
    assert set(result["phases"]) >= {"time/update_s", "time/logprobs_s", "rollout/time_s"}
    assert "Trained 2 steps" in result["console"]
