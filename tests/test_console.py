"""What ``ngrpo train`` prints: a header, a step bar, the summary; not the libraries' routine lines
(they come back with ``-v``)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

NOISE = [
    "GPU available",
    "TPU available",
    "litlogger",
    "Creating initial MLflow database",
    "Experiment with name",
    "system metrics monitoring",
    "Modules in train mode",
    "FLOPs",
    "Epoch 0",
    "version_base",
    "Loading weights",
    "nan before",
    "`Trainer.fit` stopped",
]
LOG_LINE = re.compile(
    r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING)|Warning:", re.M
)  # a library's log or warning


def run(tmp: Path, *extra: str) -> str:
    ngrpo = Path(sys.executable).parent / "ngrpo"
    cmd = [str(ngrpo), "train", "model=tiny", "trainer.max_steps=2", "data.val_size=4", "reward.num_workers=1", *extra]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def consoles(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console")
    # the verbose run also has no validation before its fit and no tracking: a process fewer
    return run(tmp), run(tmp, "-v", "output_dir=outputs2", "validate_before_fit=false", "logger=none")


def test_the_console_shows_the_run_not_the_libraries(consoles):
    quiet, _ = consoles
    assert "ngrpo train: temperature x grpo, 2 steps" in quiet
    assert "  model:    tiny (float32)" in quiet and "  task:     reasoning_gym (chain_sum)" in quiet
    assert "  tracking: MLflow sqlite:///mlruns/mlflow.db (experiment 'grpo')" in quiet
    assert "step 2/2" in quiet and "reward=" in quiet and "tok/s=" in quiet
    assert "Trained 2 steps in" in quiet and "validation accuracy:" in quiet and "MLflow run:" in quiet
    shown = [line for line in NOISE if line in quiet]
    assert not shown, f"library noise on the console: {shown}"
    assert not LOG_LINE.search(quiet), LOG_LINE.search(quiet)


def test_eval_shows_its_results_not_the_libraries(tmp_path):
    """``ngrpo eval`` of the defaults' model on a new MLflow store: the results, no store creation,
    no experiment creation, no weight-loading bar, no library warning."""
    ngrpo = Path(sys.executable).parent / "ngrpo"
    cmd = [str(ngrpo), "eval", "model=tiny", "n=1", "limit=2", "max_new_tokens=4", "reward.num_workers=1"]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "Evaluated tiny (float32) on reasoning_gym (2 problems x 1 samples, seed 0: default)" in out
    assert out.startswith("ngrpo eval: tiny\n") and "eval: 100%" in out and "MLflow run:" in out  # header, progress
    shown = [line for line in NOISE if line in out]
    assert not shown, f"library noise on the console: {shown}"
    assert not LOG_LINE.search(out), LOG_LINE.search(out)


def test_verbose_brings_the_libraries_back(consoles):
    _, verbose = consoles
    assert "GPU available" in verbose and "Trained 2 steps in" in verbose


def test_validation_that_did_not_run_says_so(consoles):
    _, verbose = consoles
    assert "validation accuracy: not run before ->" in verbose


def test_the_tests_run_the_configuration_libraries_users_get():
    """The dev extra's launcher asks for hydra-core >= 1.1.0.dev7, a pre-release specifier that would
    let pip install Hydra's and OmegaConf's release candidates under `make test` only: the package
    bounds both to the releases `make train` installs."""
    from importlib.metadata import version

    from packaging.version import Version

    for name, below in (("hydra-core", "1.4"), ("omegaconf", "2.4")):
        installed = Version(version(name))
        assert not installed.is_prerelease and installed < Version(below), (name, installed)


def test_the_package_s_own_notes_reach_the_user_once_each_from_the_first_rank():
    """Python shows a library's INFO lines nowhere by default: a run's notes (how a sharded policy
    decodes, an explorer whose steps run between replayed graphs) go to stderr as ``ngrpo: ...``,
    from the first rank only. A fresh process: the logging set-up is per process."""
    code = (
        "import logging\n"
        "from lightning.fabric.utilities.rank_zero import rank_zero_only\n"
        "from ngrpo_lightning.tracking.console import quiet_libraries\n"
        "quiet_libraries(); quiet_libraries()\n"  # a second call adds no second handler
        "log = logging.getLogger('ngrpo_lightning.rollout.hf_engine')\n"
        "log.info('explorer %s does not declare capturable', 'Mine')\n"
        "rank_zero_only.rank = 1\n"
        "log.info('said by a second rank')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["ngrpo: explorer Mine does not declare capturable"]


def test_the_header_counts_steps_in_words():
    from ngrpo_lightning.config import compose
    from ngrpo_lightning.tracking.console import header

    assert header(compose(["model=tiny", "trainer.max_steps=1"])).startswith(
        "ngrpo train: temperature x grpo, 1 step\n"
    )
    assert ", 3 steps\n" in header(compose(["model=tiny", "trainer.max_steps=3"]))


def test_a_failing_step_ends_the_bar_s_line_before_the_error(tiny, capsys):
    """The error the command prints after a failed step (a full disk, a crash) starts on its own line."""
    import lightning as L
    from conftest import ScriptedReward, tiny_rl

    from ngrpo_lightning.tracking.console import StepProgressBar

    class Fail(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            raise RuntimeError("step 1 failed")

    module, datamodule = tiny_rl(tiny, ScriptedReward([1, 0]))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[StepProgressBar(), Fail()],
    )
    with pytest.raises(RuntimeError, match="step 1 failed"):
        trainer.fit(module, datamodule)
    out = capsys.readouterr().out
    assert "step 1/2" in out and out.endswith("\n")


def test_the_package_s_warnings_read_as_its_own_and_others_as_before():
    import warnings

    from ngrpo_lightning.checkpoints import disk
    from ngrpo_lightning.tracking.console import show_own_warnings

    before = warnings.formatwarning
    try:
        show_own_warnings()
        show_own_warnings()  # once: not wrapped twice
        ours = warnings.formatwarning("the disk is small", UserWarning, disk.__file__, 131)
        assert ours == "ngrpo: warning: the disk is small\n"
        theirs = warnings.formatwarning("deprecated", UserWarning, "/somewhere/else/lib.py", 7)
        assert theirs == before("deprecated", UserWarning, "/somewhere/else/lib.py", 7)
        assert not getattr(before, "ngrpo", False) or warnings.formatwarning is before
    finally:
        warnings.formatwarning = before
