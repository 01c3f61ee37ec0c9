"""End to end: `ngrpo train` on the tiny model into a temporary SQLite MLflow store."""

import math
import shutil

import pytest
import torch
from mlflow import MlflowClient

from ngrpo_lightning.checkpoints.safe_load import load_checkpoint
from ngrpo_lightning.commands.cli import main, train
from ngrpo_lightning.config import ConfigError, compose

TINY_RUN = [
    "model=tiny",
    "trainer.max_steps=2",
    "data.train_size=16",
    "data.val_size=4",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "logger.log_samples_every=1",
    "trainer.enable_progress_bar=false",
]

REQUIRED_METRICS = [
    "train/reward",
    "train/accuracy",
    "train/response_length_mean",
    "train/response_length_max",
    "train/truncated_frac",
    "train/loss",
    "train/kl_ref",
    "train/clip_frac_low",
    "train/clip_frac_high",
    "train/entropy",
    "train/grad_norm",
    "lr-AdamW",
    "rollout/tokens_per_s",
    "time/step_s",
    "reward/timeout_frac",
    "explore/mixed_frac",
    "val/accuracy",
]


def test_two_training_steps_are_logged_to_mlflow(store, tmp_path):
    cfg = compose(TINY_RUN + [f"logger.tracking_uri={store}", f"output_dir={tmp_path}/out"])
    summary = train(cfg)
    assert summary["steps"] == 2
    client = MlflowClient(store)
    run = client.get_run(summary["run_id"])
    assert client.get_experiment(run.info.experiment_id).name == "grpo"
    for key in REQUIRED_METRICS:
        history = client.get_metric_history(run.info.run_id, key)
        assert history, f"metric {key} was not logged"
        assert all(math.isfinite(m.value) for m in history), key
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 2
    assert run.data.params["explorer.name"] == "temperature"
    assert run.data.params["objective.kl_coef"] == "0.001"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "samples"} <= artifacts
    assert len(client.list_artifacts(run.info.run_id, "samples")) == 2
    from ngrpo_lightning.backends.packing import packing_available

    if packing_available(torch.float32):  # what the backend measured and chose on this machine
        assert "backend_choices.json" in artifacts
    assert "mlflow ui --backend-store-uri" in summary["text"]
    (view,) = [line.split("view it:", 1)[1].split() for line in summary["text"].splitlines() if "view it:" in line]
    assert shutil.which(view[0]) is not None, view  # runs as printed: mlflow on the PATH, else this environment's


def test_cli_prints_summary_and_run_id(store, capsys):
    assert (
        main(["train", *TINY_RUN, "trainer.max_steps=1", "validate_before_fit=false", f"logger.tracking_uri={store}"])
        == 0
    )
    out = capsys.readouterr().out
    assert "Trained 1 step " in out and "MLflow run:" in out


def test_pass_at_k_from_the_config_is_logged(store, tmp_path):
    cfg = compose(
        TINY_RUN
        + [f"logger.tracking_uri={store}", f"output_dir={tmp_path}/out", "pass_at_k.n=2", "validate_before_fit=false"]
    )
    summary = train(cfg)
    client = MlflowClient(store)
    run = client.get_run(summary["run_id"])
    for key in ("val/reasoning_gym/pass_at_1", "val/reasoning_gym/pass_at_2", "val/reasoning_gym/mean_at_2"):
        assert key in run.data.metrics, f"{key} missing: {sorted(run.data.metrics)}"
        assert 0.0 <= run.data.metrics[key] <= 1.0
    assert run.data.metrics["val/reasoning_gym/pass_at_2"] >= run.data.metrics["val/reasoning_gym/pass_at_1"]


def test_a_run_validated_only_around_its_fit_keeps_its_final_weights_as_best(store, tmp_path):
    """Lightning's checkpoint callback looks at validations inside the fit only: a short run, validated
    before and after it, kept no best.ckpt. The validation after the fit counts; the one before
    scores the initial weights, which no checkpoint holds, and does not."""
    import torch

    out = tmp_path / "out"
    extra = [f"logger.tracking_uri={store}", f"output_dir={out}", "checkpoint.best=val/accuracy"]
    summary = train(compose(TINY_RUN + extra + ["checkpoint.every_n_steps=0"]))  # validates every 50 steps
    history = [m.value for m in MlflowClient(store).get_metric_history(summary["run_id"], "val/accuracy")]
    assert len(history) == 2  # before and after the fit
    best, last = (load_checkpoint(out / f"checkpoints/{name}.ckpt", mmap=False) for name in ("best", "last"))
    (state,) = [v for k, v in best["callbacks"].items() if "val/accuracy" in k]
    assert float(state["best_model_score"]) == history[-1] and best["global_step"] == 2
    assert best["state_dict"].keys() == last["state_dict"].keys()
    assert all(torch.equal(best["state_dict"][k], v) for k, v in last["state_dict"].items())


def test_a_best_metric_the_run_does_not_log_is_refused_before_training_or_warned_of_during_it(tmp_path, capsys):
    """checkpoint.best=val/acc (a misspelling): refused at the validation before the fit, naming the
    metrics the run logs, before any step; without that validation, the first one inside the fit
    warns and the run finishes without best.ckpt (Lightning's callback had stopped it there)."""
    common = [*TINY_RUN, "logger=none", "checkpoint.best=val/acc"]
    assert main(["train", *common, f"output_dir={tmp_path}/a"]) == 2
    assert (
        "checkpoint.best='val/acc' is not a validation metric of this run: it logs ['val/accuracy', 'val/reward']"
        in (capsys.readouterr().err)
    )
    assert not (tmp_path / "a/checkpoints/last.ckpt").exists()  # refused before the first step
    late = [f"output_dir={tmp_path}/b", "validate_before_fit=false", "trainer.val_check_interval=1"]
    with pytest.warns(UserWarning, match="checkpoint.best='val/acc' is not a validation metric.*without best.ckpt"):
        summary = train(compose(common + late))
    assert summary["steps"] == 2 and (tmp_path / "b/checkpoints/last.ckpt").exists()
    assert not (tmp_path / "b/checkpoints/best.ckpt").exists()


def test_a_pass_at_k_best_metric_the_run_does_not_log_is_refused_before_any_step(tmp_path, capsys):
    """checkpoint.best=val/avg/mean_at_3 with pass_at_k.n=2 (the run logs mean@2): refused at set-up,
    naming the Pass@k metrics the run logs; and a Pass@k metric in a run without Pass@k."""
    common = [*TINY_RUN, "logger=none", "checkpoint.best=val/avg/mean_at_3"]
    assert main(["train", *common, "pass_at_k.n=2", f"output_dir={tmp_path}/a"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.best='val/avg/mean_at_3' is not a Pass@k metric of this run: it logs [" in err
    assert "'val/avg/mean_at_2'" in err and "'val/avg/pass_at_2'" in err
    assert main(["train", *common, f"output_dir={tmp_path}/b"]) == 2
    assert "this run evaluates no Pass@k (pass_at_k.n > 0 and a validation set)" in capsys.readouterr().err
    assert not list(tmp_path.glob("*/checkpoints/*.ckpt"))  # refused before the first step


def test_best_checkpoint_by_a_pass_at_k_metric_as_mlflow_names_it(store, tmp_path):
    """checkpoint.best=val/avg/mean_at_2 (MLflow's name of Lightning's mean@2): scored at each of the
    Pass@k callback's evaluations, which validations do not see (Lightning's callback kept none)."""

    out = tmp_path / "out"
    extra = ["pass_at_k.n=2", "pass_at_k.every_n_steps=1", "checkpoint.best=val/avg/mean_at_2", "trainer.max_steps=3"]
    summary = train(compose(TINY_RUN + [f"logger.tracking_uri={store}", f"output_dir={out}", *extra]))
    history = {m.step: m.value for m in MlflowClient(store).get_metric_history(summary["run_id"], "val/avg/mean_at_2")}
    assert sorted(history) == [1, 2, 3]  # one evaluation a step
    best = load_checkpoint(out / "checkpoints/best.ckpt", mmap=False)
    (state,) = [v for k, v in best["callbacks"].items() if "mean@2" in k]
    first_best = min(step for step, value in history.items() if value == max(history.values()))
    assert (
        float(state["best_model_score"]) == pytest.approx(max(history.values())) and best["global_step"] == first_best
    )


def test_best_checkpoint_by_a_validation_metric(store, tmp_path):
    """checkpoint.best=val/accuracy keeps best.ckpt beside last.ckpt, scored by that metric; the run
    validates before fit and then during it (the validation metrics survive both)."""

    summary = train(
        compose(
            TINY_RUN
            + [
                f"logger.tracking_uri={store}",
                f"output_dir={tmp_path}/out",
                "trainer.max_steps=3",
                "trainer.val_check_interval=1",
                "checkpoint.best=val/accuracy",
                "checkpoint.every_n_steps=0",
            ]
        )
    )
    best = load_checkpoint(tmp_path / "out/checkpoints/best.ckpt", mmap=False)
    (state,) = [v for k, v in best["callbacks"].items() if "val/accuracy" in k]
    history = [m.value for m in MlflowClient(store).get_metric_history(summary["run_id"], "val/accuracy")]
    assert state["monitor"] == "val/accuracy" and float(state["best_model_score"]) == max(history)
    assert (tmp_path / "out/checkpoints/last.ckpt").exists()
    with pytest.raises(ConfigError, match=r"checkpoint\.best_mode='top' is unknown"):  # one line, not a traceback
        from ngrpo_lightning.checkpoints.run import build_checkpointing

        build_checkpointing(compose(["checkpoint.best=val/accuracy", "checkpoint.best_mode=top"]))
