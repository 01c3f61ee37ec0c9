"""`ngrpo train --multirun`: every combination is its own tagged MLflow run in its own folder,
a failed arm is reported and the sweep goes on, a re-run skips what finished; the basic and
joblib launchers."""

import json
import os
from pathlib import Path

import pytest
from conftest import TINY_JOB
from mlflow import MlflowClient

import ngrpo_lightning
from ngrpo_lightning.checkpoints.trained_policy import find_checkpoint, read_checkpoint
from ngrpo_lightning.commands.cli import main
from ngrpo_lightning.commands.sweep import folder_name

TINY = [*TINY_JOB, "trainer.max_steps=1", "data.val_size=2"]


def sweep_runs(store, sweep):
    client = MlflowClient(store)
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(experiments, filter_string=f"tags.`ngrpo.sweep` = '{sweep}'")


def jobs(tmp_path, sweep):
    records = [json.loads(p.read_text()) for p in (tmp_path / "multirun" / sweep).glob("*/sweep_job.json")]
    return {tuple(j["overrides"]): j for j in records}


def test_basic_sweep_tags_runs_reports_failures_and_skips_finished_jobs(store, tmp_path, capsys):
    # a prompt cap below every prompt fails two of the four runs as they start (their configs pass the
    # sweep's checks: only the tokenized prompts tell)
    cmd = [
        "train",
        "-m",
        *TINY,
        f"logger.tracking_uri={store}",
        "sweep=s1",
        "seed=0,1",
        "data.max_prompt_tokens=4096,8",
    ]
    assert main(cmd) == 1  # two of the four runs fail: the sweep reports it
    text = capsys.readouterr().out
    assert "Sweep s1 (4 runs)" in text and text.count("| finished |") == 2 and text.count("| failed: ") == 2
    assert "data.max_prompt_tokens=8" in text and "sweep=s1 to try them again" in text
    assert "2 of them on a setting, which must change first" in text
    done = jobs(tmp_path, "s1")
    assert len(done) == 4 and len({j["arm"] for j in done.values()}) == 2
    ok = {k: j for k, j in done.items() if j["status"] == "finished"}
    assert {j["seed"] for j in ok.values()} == {0, 1} and {j["arm"] for j in ok.values()} == {
        "data.max_prompt_tokens=4096"
    }
    failed = [j["error"] for j in done.values() if j["status"] == "failed"]
    assert all("longer than data.max_prompt_tokens=8 tokens" in error for error in failed)
    every = sweep_runs(store, "s1")  # the failed jobs' runs too: they failed after their run started
    assert sorted(r.info.status for r in every) == ["FAILED", "FAILED", "FINISHED", "FINISHED"]
    runs = [r for r in every if r.info.status == "FINISHED"]
    assert sorted(r.info.run_id for r in runs) == sorted(j["run_id"] for j in ok.values())
    for r in runs:
        tags = r.data.tags
        assert tags["ngrpo.arm"] == "data.max_prompt_tokens=4096" and tags["ngrpo.explorer"] == "temperature"
        assert tags["ngrpo.objective"] == "grpo" and tags["ngrpo.seed"] in {"0", "1"}
        assert tags["ngrpo.version"] == ngrpo_lightning.__version__  # and, from a checkout, its commit
        assert r.data.params["seed"] == tags["ngrpo.seed"] and r.info.status == "FINISHED"
    folders = {r.data.params["output_dir"] for r in runs}
    assert len(folders) == 2 and all("multirun/s1/" in f for f in folders)
    names = {Path(f).name.split(",data.prompts")[0] for f in folders}
    assert names == {"data.max_prompt_tokens=4096,seed=0", "data.max_prompt_tokens=4096,seed=1"}
    for folder in folders:  # each job records the command that retrains it, not Hydra's sweep internals
        command = read_checkpoint(find_checkpoint(folder)).meta["command"]
        assert command.startswith("ngrpo train ") and "hydra." not in command and "--multirun" not in command
        assert "data.max_prompt_tokens=4096" in command and ("seed=0" in command or "seed=1" in command)

    assert main(cmd) == 1  # again: the finished runs are skipped, the failed ones tried again
    assert sum(r.info.status == "FINISHED" for r in sweep_runs(store, "s1")) == 2
    again = jobs(tmp_path, "s1")
    assert all(again[k]["run_id"] == j["run_id"] and "resumed" in again[k] for k, j in ok.items())


def test_a_setting_no_job_can_run_refuses_the_sweep_before_any_job_trains(tmp_path, monkeypatch, capsys):
    """Every job's config is checked first, as one run's is: a key one arm does not take, or a list
    where a sweep was meant (seed=[0,1] stopped the sweep with a traceback), refuses the whole sweep,
    naming the job; nothing is written."""
    monkeypatch.chdir(tmp_path)
    base = ["train", "-m", *TINY, f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db", "sweep=bad"]
    assert main([*base, "seed=0,1", "explorer=neighbor,temperature", "explorer.k=4"]) == 2
    err = capsys.readouterr().err
    assert "the sweep's job seed=0 explorer=temperature: unknown config key 'explorer.k'" in err
    assert main([*base, "seed=[0,1]"]) == 2
    assert "seed=[0, 1] must be an integer" in capsys.readouterr().err
    assert not (tmp_path / "multirun").exists()
    assert main(["train", *TINY, "seed=0,1"]) == 2  # a sweep's list without -m
    assert "a comma-separated list sweeps its values, which needs -m" in capsys.readouterr().err


def test_joblib_launcher_runs_jobs_in_parallel_processes(store, tmp_path, capsys):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    cmd = ["train", "-m", *TINY, f"logger.tracking_uri={store}", "sweep=j1", "seed=3,4"]
    assert main([*cmd, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]) == 0
    assert "Sweep j1 (2 runs)" in capsys.readouterr().out
    runs = sweep_runs(store, "j1")
    assert sorted(r.data.tags["ngrpo.seed"] for r in runs) == ["3", "4"]
    assert all(r.info.status == "FINISHED" and r.data.tags["ngrpo.arm"] == "temperature x grpo" for r in runs)


def test_a_jobs_folder_names_the_swept_keys_first_and_stays_within_its_length():
    from ngrpo_lightning.commands.sweep import folder_name

    common = "data.tasks=[basic_arithmetic,chain_sum],data.val_size=4,model=tiny,rollout.group_size=2"
    name = folder_name(f"{common},experiment=ngrpo,rollout.max_new_tokens=8,seed=1", {"experiment", "seed"})
    assert name.startswith("experiment=ngrpo,seed=1,data.tasks=_basic_arithmetic,chain_sum_,data.val_size=4")
    assert len(name) == 99 and name != folder_name(f"{common},experiment=ngrpo,rollout.max_new_tokens=9,seed=1")
    assert folder_name("experiment=grpo,seed=0", {"experiment", "seed"}) == "experiment=grpo,seed=0"


def job_folder(sweep: str, args: list[str]) -> Path:
    """The folder of the sweep's job of ``args`` (one value per swept key), as Hydra names it:
    its overrides, one per key (the last), sorted, values as Hydra writes them (``False``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    items = {
        o.get_key_element(): f"{o.get_key_element()}={o.get_value_element_as_str()}"
        for o in OverridesParser.create().parse_overrides(args)
        if o.get_key_element() not in ("sweep", "logger.tracking_uri")
    }
    return Path("multirun") / sweep / folder_name(",".join(sorted(items.values())), {"seed"})


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_stops_the_sweep_and_a_rerun_trains_what_did_not_finish(store, tmp_path, capsys):
    """The first job's checkpoint finds the disk full (written to /dev/full): the second job is not
    started (it would fail at its first checkpoint, its steps lost), the table says to free space;
    the same command afterwards trains both."""
    args = [*TINY, "data.val_size=0", "checkpoint.every_n_steps=1", f"logger.tracking_uri={store}"]
    first = job_folder("full", [*args, "seed=0"]) / "checkpoints"
    first.mkdir(parents=True)
    os.symlink("/dev/full", first / ".step-1.ckpt.partial")
    cmd = ["train", "-m", *args, "sweep=full", "seed=0,1"]
    assert main(cmd) == 1
    text = capsys.readouterr().out
    assert "| failed: DiskFull: checkpoint " in text and "| not started: DiskFull: an earlier job's checkpoint" in text
    assert "the disk of the checkpoints is full: free space first" in text
    done = {j["seed"]: j for j in jobs(tmp_path, "full").values()}
    assert done[0]["status"] == "failed" and done[1]["status"] == "not started"
    assert not (job_folder("full", [*args, "seed=1"]) / "checkpoints").exists()  # nothing trained
    assert main(cmd) == 0  # the partial file's link went with the failed write: there is room now
    assert {j["status"] for j in jobs(tmp_path, "full").values()} == {"finished"}
    assert "| finished | not run -> not run |" in capsys.readouterr().out  # no validation set
