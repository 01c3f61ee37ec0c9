"""benchmarks/main_job.py (harness.py main_job): the whole `ngrpo train` command measured as a user runs it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_JOB

if not Path("/proc/self/status").exists():
    pytest.skip("reads the kernel's peak RSS from /proc (Linux)", allow_module_level=True)
BENCHMARKS = str(Path(__file__).parents[1] / "benchmarks")
sys.path.insert(0, BENCHMARKS)
import common  # noqa: E402
import main_job  # noqa: E402


def test_the_kernel_high_water_mark_of_a_live_process():
    assert common.status_bytes("VmHWM", os.getpid()) > 50 * 2**20  # this test process, torch imported
    assert common.status_bytes("VmHWM", 2**22 + 12345) == 0  # no such process


@pytest.mark.parametrize("way", ["ngrpo", "script"])
def test_a_short_run_is_measured_whole(monkeypatch, way):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    overrides = [o for o in TINY_JOB if not o.startswith("logger.")] + ["trainer.max_steps=2"]
    result = main_job.measure(overrides, way)
    assert len(result["steps_s"]) == 2 and result["step_s"] in result["steps_s"][1:]
    assert 0 < sum(result["steps_s"]) < result["wall_s"]  # the steps happen inside the whole command
    # the trainer's peak is above that of a process that only imports torch and Lightning (it also
    # loads a model and trains it): the imports are measured, and the sampled tree saw the trainer
    code = "import os, torch, lightning, sys; sys.path.insert(0, sys.argv[1]); import common; "
    code += "print(common.status_bytes('VmHWM'))"
    imports_only = int(subprocess.run([sys.executable, "-c", code, BENCHMARKS], capture_output=True, text=True).stdout)
    assert result["main_peak_bytes"] > imports_only > 50 * 2**20
    assert result["tree_peak_bytes"] > 100 * 2**20
    assert result["tree_peak_bytes"] <= result["main_peak_bytes"] * 4  # a few answer-checking workers, not a leak
    assert set(result["phases"]) >= {"time/update_s", "time/logprobs_s", "rollout/time_s"}
    if way == "ngrpo":
        assert "Trained 2 steps" in result["console"]


def test_each_way_is_the_command_a_user_runs(tmp_path):
    overrides = ["trainer.max_steps=2", "logger.tracking_uri=sqlite:///x.db"]
    make = main_job.command("make", overrides, tmp_path)
    assert make[:2] == ["make", "-s"] and "train" in make and make[-1] == "ARGS=" + " ".join(overrides)
    assert main_job.command("ngrpo", overrides, tmp_path)[1:] == ["train", *overrides]
    script = main_job.command("script", overrides, tmp_path)
    assert script[-1] == "sqlite:///x.db" and "build_run(overrides)" in (tmp_path / "script.py").read_text()


def test_a_way_may_name_the_environment_it_runs_with():
    assert main_job.split_way("ngrpo") == ("ngrpo", {})
    env = {"THP_MEM_ALLOC_ENABLE": "0", "A": "b=c"}
    assert main_job.split_way("make,THP_MEM_ALLOC_ENABLE=0,A=b=c") == ("make", env)
    for bad in ("ngrpo,THP_MEM_ALLOC_ENABLE", "trl,A=1"):
        with pytest.raises(ValueError, match="--via"):
            main_job.split_way(bad)
