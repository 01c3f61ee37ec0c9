"""Checkpoints and disk space: the warning before a run whose checkpoints will not fit, and one
clear error (the earlier checkpoints kept, resumable) when a save finds the disk full."""

import os
from pathlib import Path

import pytest
import torch
from conftest import ScriptedReward, fresh_store, tiny_rl, tiny_trainer
from mlflow import MlflowClient

from ngrpo_lightning.checkpoints.disk import DiskFull, DiskSpaceCheck, checkpoint_bytes, no_space
from ngrpo_lightning.checkpoints.io import StreamingCheckpointIO, partial_path
from ngrpo_lightning.checkpoints.safe_load import load_checkpoint
from ngrpo_lightning.commands.cli import main

FULL = Path("/dev/full")  # every write to it fails with "no space left on device"
needs_dev_full = pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full (Linux)")

TINY = [
    "model=tiny",
    "data.train_size=4",
    "data.val_size=0",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=4",
    "trainer.enable_progress_bar=false",
]


def fill_disk_for(target: Path) -> None:
    """Make the write of ``target`` land on a full device: its partial file is a link to /dev/full."""
    target.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(FULL, partial_path(target))


@needs_dev_full
def test_a_write_that_finds_the_disk_full_is_one_error_and_the_old_checkpoint_stays(tmp_path):
    target = tmp_path / "last.ckpt"
    io = StreamingCheckpointIO()
    io.save_checkpoint({"step": 1, "w": torch.ones(1000)}, target)
    fill_disk_for(target)
    with pytest.raises(DiskFull, match=rf"checkpoint {target} was not written: its disk is full") as err:
        io.save_checkpoint({"step": 2, "w": torch.zeros(1000)}, target)
    assert "resume=last continues from the last one" in str(err.value) and err.value.errno == 28
    assert torch.load(target, weights_only=True)["step"] == 1  # unchanged
    assert not os.path.lexists(partial_path(target))  # nothing left beside it


def test_other_write_errors_are_not_called_a_full_disk(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise TypeError("not today")

    with pytest.raises(TypeError, match="not today"):
        StreamingCheckpointIO().save_checkpoint({"x": Unpicklable()}, tmp_path / "a.ckpt")
    assert not list(tmp_path.iterdir())


@needs_dev_full
@pytest.mark.parametrize("writer", ["synchronous", "asynchronous"])
def test_ngrpo_train_stops_with_one_line_when_a_checkpoint_finds_the_disk_full_and_resumes(tmp_path, capsys, writer):
    """Step 2's checkpoint finds the disk full: exit status 1, one line naming the file, the MLflow
    run FAILED, step 1's checkpoint intact; once there is space, resume=last trains on from it.
    Written in the background, the failure is found at the next save or at the end, and the run
    ends as a synchronous one does (the next test has the case this one did not catch)."""
    store = fresh_store(tmp_path / "mlruns.db")
    out = tmp_path / "out"
    args = [*TINY, f"logger.tracking_uri={store}", f"output_dir={out}", "checkpoint.every_n_steps=1"]
    args += ["checkpoint.async_save=true"] if writer == "asynchronous" else []
    fill_disk_for(out / "checkpoints" / "step-2.ckpt")
    assert main(["train", *args, "trainer.max_steps=3"]) == 1
    err = capsys.readouterr().err
    assert f"ngrpo train: error: checkpoint {out}/checkpoints/step-2.ckpt was not written: its disk is full" in err
    assert "Traceback" not in err
    last = out / "checkpoints" / "last.ckpt"
    assert last.resolve().name == "step-1.ckpt" and load_checkpoint(last, mmap=False)["global_step"] == 1
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    assert run.info.status == "FAILED"
    assert main(["train", *args, "trainer.max_steps=3", "resume=last"]) == 0
    assert load_checkpoint(last, mmap=False)["global_step"] == 3


def test_the_estimate_is_what_a_checkpoint_holds_and_a_small_disk_warns(tiny, tmp_path):
    module, datamodule = tiny_rl(tiny, ScriptedReward([1, 0]))
    check = DiskSpaceCheck(tmp_path / "checkpoints", every_n_steps=1, keep=3, best=True, free_bytes=1)
    trainer = tiny_trainer(1, callbacks=[check])
    with pytest.warns(
        UserWarning, match=r"its disk has 0 MiB free, and this run keeps up to 4 checkpoints of about .* each"
    ):
        trainer.fit(module, datamodule)
    assert trainer.global_step == 1  # a warning: the run goes on
    weights, optimizer = checkpoint_bytes(module)
    assert optimizer == 2 * sum(p.numel() * 4 for p in module.policy.parameters())  # AdamW's moments, fp32
    assert check.needed == 5 * (weights + optimizer)  # 4 kept and the one being written
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert (tmp_path / "a.ckpt").stat().st_size == pytest.approx(weights + optimizer, rel=0.05)


def test_a_disk_with_room_says_nothing(tiny, tmp_path, recwarn):
    module, datamodule = tiny_rl(tiny, ScriptedReward([1, 0]))
    check = DiskSpaceCheck(tmp_path, every_n_steps=1, keep=-1)
    tiny_trainer(2, callbacks=[check]).fit(module, datamodule)
    assert check.needed == 4 * sum(checkpoint_bytes(module))  # steps 1, 2 (and the last's), one being written
    assert not [w for w in recwarn if "its disk has" in str(w.message)]


@pytest.mark.parametrize(
    "every, keep, best, max_steps, kept",
    [(0, -1, False, 10, 1), (2, 0, False, 10, 1), (2, 3, True, 10, 4), (2, -1, False, 5, 4), (2, -1, False, -1, None)],
)
def test_how_many_checkpoints_a_run_keeps(every, keep, best, max_steps, kept):
    trainer = tiny_trainer(max_steps)
    assert DiskSpaceCheck(".", every, keep, best).kept(trainer) == kept


def test_an_mlflow_store_on_a_full_disk_is_one_line_before_anything_runs(small_disk, tmp_path, capsys):
    disk = small_disk("600k")  # less than a new MLflow store takes
    store = f"sqlite:///{disk}/mlflow.db"
    assert main(["train", *TINY, f"logger.tracking_uri={store}", f"output_dir={tmp_path}/out"]) == 1
    err = capsys.readouterr().err
    assert f"ngrpo train: error: MLflow store {disk}/mlflow.db was not written: its disk is full" in err
    assert "Nothing has run yet" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_what_counts_as_a_full_disk():
    import sqlite3

    try:
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.Error as inner:
            raise RuntimeError("the store failed") from inner
    except RuntimeError as err:
        assert no_space(err)  # SQLite's words, under another error
    assert no_space(OSError(28, "No space left on device"))
    assert not no_space(RuntimeError("unexpected pos 704 vs 598"))  # torch's words alone: the free space decides
    assert not no_space(OSError(13, "Permission denied"))


@needs_dev_full
def test_any_other_write_that_finds_the_disk_full_is_one_line_too(tmp_path, monkeypatch, capsys):
    """A write that is not a checkpoint's (here a callback's; MLflow's metrics, a library's file)."""
    import lightning as L

    from ngrpo_lightning.commands import train as train_job

    class WritesAFile(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            with open(FULL, "w") as f:
                f.write("a line of a log\n")

    monkeypatch.setattr(train_job, "build_pass_at_k", lambda cfg, problems: [WritesAFile()])
    store = fresh_store(tmp_path / "mlruns.db")
    assert main(["train", *TINY, f"logger.tracking_uri={store}", f"output_dir={tmp_path}/out"]) == 1
    err = capsys.readouterr().err
    assert "ngrpo train: error: a write found the disk full: [Errno 28] No space left on device." in err
    assert "resume=last continues from the last one" in err and "Traceback" not in err


def test_an_evaluation_whose_results_find_the_disk_full_is_one_line(small_disk, capsys):
    disk = small_disk("1k")
    args = ["model=tiny", "n=1", "data.val_size=2", "max_new_tokens=4", "logger=none", "reward.num_workers=1"]
    assert main(["eval", *args, f"output_dir={disk}/eval"]) == 1
    err = capsys.readouterr().err
    assert "ngrpo eval: error: a write found the disk full: [Errno 28] No space left on device." in err
    assert "Traceback" not in err and "resume=last" not in err  # nothing to resume


def test_a_run_checks_the_disk_of_a_local_output_dir_only(tmp_path):
    from ngrpo_lightning.checkpoints.run import build_checkpointing
    from ngrpo_lightning.config import compose

    keys = ["checkpoint.every_n_steps=5", "checkpoint.keep=2", "checkpoint.best=val/accuracy"]
    (check,) = [
        c for c in build_checkpointing(compose([*keys, f"output_dir={tmp_path}"])) if isinstance(c, DiskSpaceCheck)
    ]
    assert (check.dirpath, check.every_n_steps, check.keep, check.best) == (tmp_path / "checkpoints", 5, 2, True)
    remote = build_checkpointing(compose([*keys, "output_dir=s3://bucket/run"]))
    assert remote and not [c for c in remote if isinstance(c, DiskSpaceCheck)]


@needs_dev_full
def test_a_background_save_that_finds_the_disk_full_stops_the_run_and_leaves_no_link_to_it(tmp_path, capsys):
    """checkpoint.async_save=true, the run's first checkpoint finds the disk full: the run stops on
    that failure, named, not on a later one, and last.ckpt, which Lightning links as soon as the save
    is asked for, does not point at the file that was never written (resume=last would find nothing)."""
    out = tmp_path / "out"
    args = [*TINY, "logger=none", f"output_dir={out}", "checkpoint.every_n_steps=1", "checkpoint.async_save=true"]
    fill_disk_for(out / "checkpoints" / "step-1.ckpt")
    assert main(["train", *args, "trainer.max_steps=3"]) == 1
    err = capsys.readouterr().err
    assert f"ngrpo train: error: checkpoint {out}/checkpoints/step-1.ckpt was not written: its disk is full" in err
    assert "Traceback" not in err
    assert list((out / "checkpoints").iterdir()) == []  # no link, no later step, nothing half-written
