"""Checkpoint and resume: a run interrupted after step k (or killed) and resumed with
``resume=last`` continues exactly where it was (weights, optimizer, RNGs, explorer, replay
buffer, data position) in the same MLflow run; a checkpoint of another config is refused."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import ScriptedReward, fresh_store, scripted_cli

from ngrpo_lightning.checkpoints.safe_load import load_checkpoint
from ngrpo_lightning.commands.cli import main, train
from ngrpo_lightning.config import ConfigError, compose

# 2 prompts x 2 samples, 2 optimizer updates per batch (mini-batches shuffled by the replay
# buffer's RNG), sampled rollouts (engine RNG), shuffled data: every piece of state matters.
RUN = [
    "model=tiny",
    "data.train_size=6",
    "data.val_size=0",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=6",
    "logger.log_samples_every=0",
    "trainer.enable_progress_bar=false",
    "train.num_mini_batches=2",
    "replay.capacity=4",
    "optim.lr=1e-2",
    "validate_before_fit=false",
]
KEYS = ["train/loss", "train/grad_norm", "train/entropy", "train/response_length_mean", "train/kl_ref", "replay/size"]
STEPS = 8  # optimizer steps = 4 rollout batches (more than one pass over the 3 batches of an epoch)


@pytest.fixture(autouse=True)
def scripted_reward(monkeypatch):
    """Rows alternate reward 1/0 (real advantages, real updates) whatever the model writes."""
    monkeypatch.setattr("ngrpo_lightning.build.components.build_reward", lambda cfg: ScriptedReward((1, 0)))


def run(tmp, name, *extra):
    store = fresh_store(Path(tmp) / "mlruns.db")
    return train(compose(RUN + [f"logger.tracking_uri={store}", f"output_dir={tmp}/{name}", *extra]))


def history(tmp, run_id, key):
    """(step, value) of a metric, the latest value per step (a killed run may have logged
    steps after its last checkpoint: the resumed run logs them again)."""
    from mlflow import MlflowClient

    points = {}
    for m in sorted(
        MlflowClient(f"sqlite:///{tmp}/mlruns.db").get_metric_history(run_id, key), key=lambda m: m.timestamp
    ):
        points[m.step] = m.value
    return sorted(points.items())


def weights(path):
    return load_checkpoint(path, mmap=False)["state_dict"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whole")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("ngrpo_lightning.build.components.build_reward", lambda cfg: ScriptedReward((1, 0)))
        summary = run(tmp, "out", f"trainer.max_steps={STEPS}")
    return tmp, summary


def assert_same_run(tmp_a, id_a, tmp_b, id_b):
    for key in KEYS:
        a, b = history(tmp_a, id_a, key), history(tmp_b, id_b, key)
        assert [s for s, _ in a] == [s for s, _ in b], key
        assert [v for _, v in a] == pytest.approx([v for _, v in b], rel=1e-5, abs=1e-6), key
    wa, wb = weights(tmp_a / "out/checkpoints/last.ckpt"), weights(tmp_b / "out/checkpoints/last.ckpt")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6, msg=k)


def test_interrupted_and_resumed_run_equals_uninterrupted_run(uninterrupted, tmp_path):
    whole_tmp, whole = uninterrupted
    # 3 rollout batches (one pass over the data), a step checkpoint at step 4 and one at the end
    first = run(tmp_path, "out", "trainer.max_steps=6", "checkpoint.every_n_steps=4", "checkpoint.keep=-1")
    last = tmp_path / "out/checkpoints/last.ckpt"
    assert last.is_symlink() and last.resolve().name == "step-6.ckpt"
    saved = load_checkpoint(last, mmap=False)
    assert saved["global_step"] == 6 and saved["policy_version"] == {"value": 6}  # one clock, saved with the run
    recorded = saved["ngrpo"]["backend_choices"]  # what the backend measured here: the resumed run decides the same
    assert recorded == {} or set(recorded) == {"packing", "measured"}
    resumed = run(
        tmp_path, "out", f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=4", "checkpoint.keep=-1", "resume=last"
    )
    assert resumed["run_id"] == first["run_id"]  # the same MLflow run continues
    assert resumed["steps"] == STEPS
    # one continuous history: every step once, equal to the uninterrupted run's
    from mlflow import MlflowClient

    raw = MlflowClient(f"sqlite:///{tmp_path}/mlruns.db").get_metric_history(first["run_id"], "train/loss")
    assert sorted(m.step for m in raw) == [0, 1, 2, 3]  # each step logged once (also where checkpoints were written)
    assert_same_run(whole_tmp, whole["run_id"], tmp_path, first["run_id"])
    ckpt = load_checkpoint(tmp_path / "out/checkpoints/last.ckpt", mmap=False)
    assert {"explorer", "rng", "ngrpo", "RolloutDataModule", "optimizer_states", "lr_schedulers", "loops"} <= set(ckpt)
    assert "generator" in ckpt["RolloutDataModule"]["engine"][0]
    assert ckpt["policy_version"] == {"value": STEPS}  # the resumed run continued the count
    assert any("ReplayBuffer" in k for k in ckpt["callbacks"])
    assert ckpt["ngrpo"]["mlflow_run_id"] == first["run_id"]


def test_a_run_resumed_mid_epoch_shows_its_progress_bar_from_where_it_was(tmp_path, capsys):
    """Lightning gives a run resumed mid-epoch no on_train_epoch_start: the bar is set up at the
    start of training too (the resume crashed in the bar before). A new experiment_name leaves
    the run in its experiment, and the summary names that one."""
    first = run(
        tmp_path, "out", "trainer.max_steps=2", "checkpoint.every_n_steps=2", "trainer.enable_progress_bar=true"
    )
    capsys.readouterr()
    resumed = run(
        tmp_path, "out", "trainer.max_steps=4", "resume=last", "trainer.enable_progress_bar=true", "experiment_name=new"
    )
    assert resumed["steps"] == 4  # 2 optimizer steps per rollout batch: batch 2 of 2 done
    assert "step 2/2" in capsys.readouterr().out
    assert resumed["run_id"] == first["run_id"] and "(experiment 'grpo')" in resumed["text"]


def killed_and_resumed(tmp_path, extra=()) -> dict:
    """A run (``RUN`` + ``extra``) in its own process, killed once its step-4 checkpoint exists,
    then resumed here with ``resume=last`` to ``STEPS``: the resumed run's summary."""
    args = RUN + [
        *extra,
        f"logger.tracking_uri={fresh_store(tmp_path / 'mlruns.db')}",
        f"output_dir={tmp_path}/out",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep=-1",
        "trainer.max_steps=1000",
    ]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [*scripted_cli(tmp_path), "train", *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    target = tmp_path / "out/checkpoints/step-4.ckpt"
    deadline = time.monotonic() + 120
    try:
        while not target.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    kept = max(int(p.stem.removeprefix("step-")) for p in (tmp_path / "out/checkpoints").glob("step-*.ckpt"))
    assert kept < STEPS
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns.db")
    (killed,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert killed.info.status == "RUNNING"  # a killed process cannot report; resume continues this run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("ngrpo_lightning.build.components.build_reward", lambda cfg: ScriptedReward((1, 0)))
        resumed = train(compose(args[:-1] + [f"trainer.max_steps={STEPS}", "resume=last"]))
    assert resumed["steps"] == STEPS
    assert (
        f"Trained {STEPS - kept} step" in resumed["text"]
        and f"from step {kept} to {STEPS} (resumed)" in resumed["text"]
    )
    assert resumed["run_id"] == killed.info.run_id
    assert client.get_run(resumed["run_id"]).info.status == "FINISHED"
    return resumed


def test_killed_run_resumes_from_its_last_checkpoint(uninterrupted, tmp_path):
    whole_tmp, whole = uninterrupted
    resumed = killed_and_resumed(tmp_path)
    assert_same_run(whole_tmp, whole["run_id"], tmp_path, resumed["run_id"])


def test_a_killed_lora_run_resumes_from_its_adapters(tmp_path):
    """The same with LoRA adapters: checkpoints hold the adapters and their optimizer state
    only, and the resumed run equals an uninterrupted one."""
    pytest.importorskip("peft")
    lora = ["model.lora.enabled=true", "model.lora.rank=4", "optim.lr=5e-2"]
    whole = run(tmp_path / "whole", "out", *lora, f"trainer.max_steps={STEPS}")
    killed = tmp_path / "killed"
    killed.mkdir()
    resumed = killed_and_resumed(killed, lora)
    saved = weights(killed / "out/checkpoints/last.ckpt")
    assert saved and all(".lora_" in k for k in saved)  # no base weights
    assert_same_run(tmp_path / "whole", whole["run_id"], killed, resumed["run_id"])


def test_resuming_another_config_names_the_mismatch(uninterrupted, capsys):
    whole_tmp, _ = uninterrupted
    base = RUN + [f"logger.tracking_uri=sqlite:///{whole_tmp}/mlruns.db", f"output_dir={whole_tmp}/out", "resume=last"]
    with pytest.raises(ConfigError, match=r"rollout\.group_size differs: the checkpoint has 2, this run has 4"):
        train(compose(base + ["rollout.group_size=4"]))
    assert main(["train", *base, "model.name_or_path=other-model"]) == 2
    assert "model.name_or_path differs" in capsys.readouterr().err


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="resume=last: no checkpoint at .*last.ckpt"):
        train(compose(RUN + [f"output_dir={tmp_path}/none", "resume=last", "logger=none"]))


def test_a_new_run_into_another_runs_output_dir_is_refused(uninterrupted, monkeypatch, capsys):
    """Nothing of the earlier run is replaced; the message names it and the three ways out."""
    whole_tmp, whole = uninterrupted
    last = whole_tmp / "out/checkpoints/last.ckpt"
    before = last.stat().st_mtime_ns

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before output_dir was checked")

    monkeypatch.setattr("ngrpo_lightning.build.components.load_policy", no_loading)
    args = RUN + [f"logger.tracking_uri=sqlite:///{whole_tmp}/mlruns.db", f"output_dir={whole_tmp}/out"]
    assert main(["train", *args, "seed=1"]) == 2
    err = capsys.readouterr().err
    assert f"output_dir={whole_tmp}/out holds another run's checkpoints" in err
    assert f"step {STEPS}" in err and f"MLflow run {whole['run_id']}" in err
    for way_out in ("resume=last", "output_dir=<another folder>", "overwrite=true"):
        assert way_out in err
    assert last.stat().st_mtime_ns == before


def test_overwrite_replaces_the_earlier_runs_checkpoints(tmp_path):
    # 2 optimizer steps per rollout batch (RUN): checkpoints at steps 2, 4, then 2 again
    first = run(tmp_path, "out", "trainer.max_steps=4", "checkpoint.every_n_steps=2", "checkpoint.keep=-1")
    ckpts = tmp_path / "out/checkpoints"
    assert (ckpts / "step-4.ckpt").exists()
    second = run(tmp_path, "out", "trainer.max_steps=2", "checkpoint.every_n_steps=2", "overwrite=true")
    assert second["run_id"] != first["run_id"]
    assert (ckpts / "step-2.ckpt").exists()
    assert not (ckpts / "step-4.ckpt").exists()  # the earlier run's step files are gone, not mixed in
    assert load_checkpoint(ckpts / "last.ckpt", mmap=False)["ngrpo"]["mlflow_run_id"] == second["run_id"]


def test_the_recorded_command_trains_the_run_from_its_start():
    # a resumed run's checkpoints and model card record the command without resume= or overwrite=
    from ngrpo_lightning.commands.train import retrain_command

    given = "ngrpo train experiment=ngrpo resume=last 'output_dir=runs/a b' overwrite=true trainer.max_steps=30"
    assert retrain_command(given) == "ngrpo train experiment=ngrpo 'output_dir=runs/a b' trainer.max_steps=30"
