"""MLflow tracking fails fast and tells the truth: an unusable store is one line before any model
loads, a run's status is RUNNING while it trains and FINISHED / FAILED at its end, runs are named
after what ran, and two runs may create the same new store at once."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import ScriptedReward
from mlflow.tracking import MlflowClient

from ngrpo_lightning.build import components
from ngrpo_lightning.checkpoints.safe_load import load_checkpoint
from ngrpo_lightning.commands import train as train_job
from ngrpo_lightning.commands.cli import main, train
from ngrpo_lightning.config import compose
from ngrpo_lightning.tracking.logger import build_logger

TINY = [
    "model=tiny",
    "data.train_size=4",
    "data.val_size=2",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=4",
    "trainer.max_steps=2",
    "logger.log_samples_every=0",
    "checkpoint.every_n_steps=0",
]


def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the tracking store was checked")

    monkeypatch.setattr(components, "load_policy", refuse)


def test_an_unreachable_server_is_one_line_before_the_model_loads(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)  # the default output_dir, outputs/, may hold a run of `make train`
    no_model_loading(monkeypatch)
    t0 = time.perf_counter()
    assert main(["train", "model=tiny", "logger.tracking_uri=http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip()
    assert time.perf_counter() - t0 < 30  # not minutes of retries
    assert len(err.splitlines()) == 1
    assert "logger.tracking_uri=http://127.0.0.1:9: the tracking server does not answer" in err and "logger=none" in err


def test_a_server_that_is_not_mlflow_is_named_as_such(monkeypatch, capsys, tmp_path):
    """A web server that answers /health with 404 (not MLflow's): said so, not "does not answer"."""
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    monkeypatch.chdir(tmp_path)
    no_model_loading(monkeypatch)
    server = ThreadingHTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_port}"
    try:
        assert main(["train", "model=tiny", f"logger.tracking_uri={uri}"]) == 2
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert f"{uri}/health answered 404 File not found: not an MLflow tracking server" in err


def test_a_store_that_cannot_be_created_names_the_key_and_the_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default output_dir, outputs/, may hold a run of `make train`
    no_model_loading(monkeypatch)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["train", "model=tiny", f"logger.tracking_uri=sqlite:///{blocker}/mlruns/mlflow.db"]) == 2
    err = capsys.readouterr().err
    assert f"logger.tracking_uri=sqlite:///{blocker}/mlruns/mlflow.db" in err and "logger=none" in err


def test_run_status_is_running_while_training_and_finished_after(tmp_path, monkeypatch):
    seen = {}

    class StatusSpy(components.L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logger = trainer.logger
            seen.setdefault("status", logger.experiment.get_run(logger.run_id).info.status)

    monkeypatch.setattr(train_job, "build_pass_at_k", lambda cfg, problems: [StatusSpy()])
    monkeypatch.setattr(components, "build_reward", lambda cfg: ScriptedReward((1, 0)))
    store = f"sqlite:///{tmp_path}/mlruns.db"
    overrides = [*TINY, f"logger.tracking_uri={store}"]
    summary = train(compose([*overrides, f"output_dir={tmp_path}/out", "logger.system_metrics_interval_s=0.2"]))
    assert seen["status"] == "RUNNING"  # the validation before fit did not end the run
    run = MlflowClient(store).get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    # system metrics, this process's memory among them, and where each step's time went
    metrics = run.data.metrics
    assert metrics["system/process_rss_megabytes"] > 100 and metrics["system/process_peak_rss_megabytes"] > 100
    assert "system/cpu_utilization_percentage" in metrics and "system/system_memory_usage_megabytes" in metrics
    assert all(metrics[f"time/{phase}_s"] > 0 for phase in ("reward", "logprobs", "update"))
    assert not [t for t in threading.enumerate() if t.name == "SystemMetricsMonitor"]  # stopped with the run
    off = train(compose([*overrides, "logger.system_metrics=false", f"output_dir={tmp_path}/off"]))
    assert not [k for k in MlflowClient(store).get_run(off["run_id"]).data.metrics if k.startswith("system/")]
    name = run.info.run_name
    assert name.startswith("grpo-temperature-grpo-seed0-") and len(name.rsplit("-", 1)[-1]) == 6


@pytest.mark.parametrize("stop, status, saved", [("Ctrl-C", 130, 1), ("SIGTERM", 143, 2)])
def test_a_stopped_run_is_killed_and_says_where_it_stopped(tmp_path, monkeypatch, capsys, stop, status, saved):
    """Ctrl-C after step 2 (a KeyboardInterrupt, as SIGINT raises it: Lightning tears the fit down
    and exits with status 1), or SIGTERM (Lightning stops after the step under way): the run is
    KILLED, not FAILED, and the command says what resumes it, with a shell's exit status."""

    class Stop(components.L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                if stop == "Ctrl-C":
                    raise KeyboardInterrupt
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(train_job, "build_pass_at_k", lambda cfg, problems: [Stop()])
    store = f"sqlite:///{tmp_path}/mlruns.db"
    out = tmp_path / "out"
    args = [*TINY, f"logger.tracking_uri={store}", f"output_dir={out}", "trainer.max_steps=4"]
    assert main(["train", *args, "checkpoint.every_n_steps=1"]) == status
    last = out / "checkpoints" / "last.ckpt"
    message = f"ngrpo train: {stop} stopped the run at step 2: resume=last continues from step {saved} ({last})"
    assert message in capsys.readouterr().err
    assert load_checkpoint(last, mmap=False)["global_step"] == saved  # Ctrl-C: before step 2's checkpoint
    (run,) = MlflowClient(store).search_runs([MlflowClient(store).get_experiment_by_name("grpo").experiment_id])
    assert run.info.status == "KILLED"


@pytest.mark.parametrize("stop, signum, status", [("Ctrl-C", signal.SIGINT, 130), ("SIGTERM", signal.SIGTERM, 143)])
def test_a_stopped_run_saves_its_last_finished_step_and_resume_continues_from_it(
    tmp_path, monkeypatch, capsys, stop, signum, status
):
    """Ctrl-C (the first one) or SIGTERM during step 2 of a run that checkpoints every 10 steps: the
    run stops after that step and saves it, so nothing finished is lost, and ``resume=last`` continues
    from step 2 (before, nothing was kept: "no checkpoint was written")."""

    class Signal(components.L.Callback):
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step == 1:  # during the second step
                os.kill(os.getpid(), signum)

    monkeypatch.setattr(train_job, "build_pass_at_k", lambda cfg, problems: [Signal()])
    store = f"sqlite:///{tmp_path}/mlruns.db"
    out = tmp_path / "out"
    args = [*TINY, f"logger.tracking_uri={store}", f"output_dir={out}", "trainer.max_steps=4"]
    assert main(["train", *args, "checkpoint.every_n_steps=10"]) == status
    last = out / "checkpoints" / "last.ckpt"
    err = capsys.readouterr().err
    assert f"ngrpo train: {stop} stopped the run at step 2: resume=last continues from step 2 ({last})" in err
    assert load_checkpoint(last, mmap=False)["global_step"] == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is Python's again
    monkeypatch.setattr(train_job, "build_pass_at_k", lambda cfg, problems: [])
    assert main(["train", *args, "checkpoint.every_n_steps=10", "resume=last"]) == 0
    assert load_checkpoint(last, mmap=False)["global_step"] == 4


def test_a_failing_run_is_marked_failed(tmp_path, monkeypatch):
    def broken(cfg):
        raise RuntimeError("the reward broke")

    monkeypatch.setattr(components, "build_reward", broken)
    store = f"sqlite:///{tmp_path}/mlruns.db"
    with pytest.raises(RuntimeError, match="the reward broke"):
        train(compose([*TINY, f"logger.tracking_uri={store}", f"output_dir={tmp_path}/out"]))
    assert not [t for t in threading.enumerate() if t.name == "SystemMetricsMonitor"]  # stopped with the run
    client = MlflowClient(store)
    (experiment,) = [e for e in client.search_experiments() if e.name == "grpo"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"


def test_run_names_differ_between_runs_of_the_same_seed(tmp_path):
    cfg = compose(["experiment=ngrpo", f"logger.tracking_uri=sqlite:///{tmp_path}/mlruns.db"])
    a, b = build_logger(cfg), build_logger(cfg)
    name_a = a.experiment.get_run(a.run_id).info.run_name
    name_b = b.experiment.get_run(b.run_id).info.run_name
    assert name_a != name_b and name_a.startswith("ngrpo-neighbor-grpo-seed0-")


CREATE = textwrap.dedent("""
    import pathlib, sys, time
    from ngrpo_lightning.config import compose
    from ngrpo_lightning.tracking.logger import build_logger
    here = pathlib.Path(sys.argv[2])
    (here / f"ready-{sys.argv[3]}").touch()
    while len(list(here.glob("ready-*"))) < 2:  # start together, once both have imported everything
        time.sleep(0.002)
    logger = build_logger(compose([f"logger.tracking_uri=sqlite:///{sys.argv[1]}", "experiment_name=race"]))
    print(logger.run_id)
""")


def test_two_runs_may_create_the_same_new_store_at_once(tmp_path):
    script = tmp_path / "create.py"
    script.write_text(CREATE)
    db = tmp_path / "new" / "mlflow.db"
    env = {"MLFLOW_DISABLE_TELEMETRY": "true", "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(db), str(tmp_path), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    run_ids = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(run_ids) == 2
    client = MlflowClient(f"sqlite:///{db}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "race"]
    assert {r.info.run_id for r in client.search_runs([experiment.experiment_id])} == run_ids
