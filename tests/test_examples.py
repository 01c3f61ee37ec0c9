"""The examples run, short: the Python API's script trains the packaged model with an explorer
written in it through Lightning's Trainer and MLFlowLogger, and reports Pass@k; it is the first
block of docs/python-api.md, as it is in examples/."""

import os
import re
import subprocess
import sys
from pathlib import Path

from mlflow import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_explorer.py"


def test_the_python_api_page_shows_the_examples_as_they_run():
    doc = (ROOT / "docs" / "python-api.md").read_text()
    first, second = re.findall(r"```python\n(.*?)```", doc, re.S)[:2]
    assert first.strip() == EXAMPLE.read_text().strip()
    assert second.strip() == (ROOT / "examples" / "sweep_and_compare.py").read_text().strip()
    body = EXAMPLE.read_text().split("class UncertainTopTwo", 1)[1].split("\n\n\n", 1)[0].splitlines()
    assert len(body) < 30  # a user's explorer: a class of under 30 lines


def test_the_custom_explorer_script_trains_logs_and_reports_pass_at_k(tmp_path):
    env = {
        **os.environ,
        "NGRPO_EXAMPLE_STEPS": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "TOKENIZERS_PARALLELISM": "false",
    }
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.search(r"^val/reasoning_gym/pass@4: \d\.\d{3}$", done.stdout, re.M), done.stdout
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("python-api").experiment_id])
    assert "train/loss" in run.data.metrics and "val/reasoning_gym/pass_at_4" in run.data.metrics
    assert (tmp_path / "outputs/python-api/checkpoints/last.ckpt").exists()  # the run's checkpoint callback
    assert "module(s) in eval mode" not in done.stderr  # the warnings the framework expects: silenced


def run_example(name: str, folder: Path, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false", **env}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def test_the_sweep_and_compare_script_trains_both_arms_and_reports_a_verdict(tmp_path):
    done = run_example(
        "sweep_and_compare.py", tmp_path, NGRPO_EXAMPLE_STEPS="1", NGRPO_EXAMPLE_SEEDS="1", NGRPO_EXAMPLE_MODEL="tiny"
    )
    assert "# Comparison: grpo, ngrpo (2 runs, 2 arms)" in done.stdout
    assert "- **Pass@1**, grpo vs ngrpo: " in done.stdout
    assert (tmp_path / "outputs/arms/compare/compare.md").is_file()


def test_the_walkthrough_trains_and_plots_reward_and_pass_at_k(tmp_path):
    done = run_example("walkthrough.py", tmp_path, NGRPO_EXAMPLE_STEPS="2")
    line = next(line for line in done.stdout.splitlines() if line.startswith("rewards: "))
    assert line.count(",") >= 1 and "pass@k: {1: " in line and "4: " in line
    assert (tmp_path / "walkthrough.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
