"""What a checkpoint holds and how it is written: streamed and atomic (a save killed midway
leaves the previous checkpoint), no frozen reference weights (the base model's id and hash
instead, checked on resume)."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ngrpo_lightning.checkpoints.io import StreamingCheckpointIO, partial_path
from ngrpo_lightning.checkpoints.run import weights_digest
from ngrpo_lightning.checkpoints.safe_load import load_checkpoint
from ngrpo_lightning.commands.cli import train
from ngrpo_lightning.config import ConfigError, compose

ROOT = Path(__file__).resolve().parents[1]


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    target, started = tmp_path / "last.ckpt", tmp_path / "started"
    StreamingCheckpointIO().save_checkpoint({"step": 1, "w": torch.ones(3)}, target)
    script = textwrap.dedent(f"""
        import time, torch
        from ngrpo_lightning.checkpoints.io import StreamingCheckpointIO

        class Slow:  # pickled in the middle of the save: the process is killed there
            def __reduce__(self):
                open({str(started)!r}, "w").close()
                time.sleep(120)
                return (int, (0,))

        StreamingCheckpointIO().save_checkpoint({{"step": 2, "w": torch.zeros(10**6), "x": Slow()}}, {str(target)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert started.exists(), "the child never reached the middle of its save"
        assert partial_path(target).exists()  # the save writes beside the target
    finally:
        proc.kill()
        proc.wait()
    assert torch.load(target)["step"] == 1  # the previous checkpoint, intact
    StreamingCheckpointIO().save_checkpoint({"step": 3}, target)  # the next save completes over the leftover
    assert torch.load(target)["step"] == 3 and not partial_path(target).exists()


RUN = [
    "data.train_size=4",
    "data.val_size=0",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=4",
    "checkpoint.every_n_steps=1",
    "logger=none",
    "validate_before_fit=false",
    "trainer.enable_progress_bar=false",
]


@pytest.fixture
def base_dir(tiny, tmp_path):
    """The tiny model saved in its own folder: a base model whose weights a test can change."""
    model, tok = tiny
    folder = tmp_path / "base"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_checkpoints_hold_the_base_models_hash_not_the_reference(base_dir, tmp_path, tiny):
    out = tmp_path / "out"
    run = lambda steps, *extra: train(  # noqa: E731
        compose([f"model.name_or_path={base_dir}", f"output_dir={out}", f"trainer.max_steps={steps}", *RUN, *extra])
    )
    run(2)
    ckpt = load_checkpoint(out / "checkpoints" / "last.ckpt", mmap=False)
    keys = ckpt["state_dict"].keys()
    assert any(k.startswith("policy.") for k in keys) and not any(k.startswith("reference.") for k in keys)
    base = ckpt["ngrpo"]["base_model"]
    assert base["name_or_path"] == str(base_dir) and base["weights_sha256"] == weights_digest(tiny[0])

    assert run(3, "resume=last")["steps"] == 3  # the same base model: the run continues
    changed = type(tiny[0]).from_pretrained(base_dir)
    with torch.no_grad():
        changed.get_input_embeddings().weight.add_(0.01)
    changed.save_pretrained(base_dir)
    with pytest.raises(ConfigError, match=r"reference is the base model .* but the base model loaded now is .*sha256"):
        run(4, "resume=last")


def test_an_asynchronous_save_writes_what_the_synchronous_one_does(tmp_path):
    """checkpoint.async_save=true: the thread writes the synchronous writer's checkpoint, the tied
    LM head once (it is the embedding: Lightning's copy stored it twice), and a run resumes from it."""
    runs = {"sync": [], "async": ["checkpoint.async_save=true"]}
    for name, extra in runs.items():
        train(compose(["model=tiny", *RUN, "trainer.max_steps=2", f"output_dir={tmp_path / name}", *extra]))
    files = {name: tmp_path / name / "checkpoints" / "last.ckpt" for name in runs}
    sync, written = (load_checkpoint(files[name], mmap=False)["state_dict"] for name in runs)
    head, embedding = written["policy.lm_head.weight"], written["policy.model.embed_tokens.weight"]
    assert head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()  # one tensor, as in the model
    assert files["async"].stat().st_size == pytest.approx(files["sync"].stat().st_size, rel=0.01)
    assert sync.keys() == written.keys() and all(torch.equal(written[k], v) for k, v in sync.items())
    resumed = ["model=tiny", *RUN, "trainer.max_steps=3", f"output_dir={tmp_path / 'async'}", *runs["async"]]
    assert train(compose([*resumed, "resume=last"]))["steps"] == 3


def test_the_newest_k_step_checkpoints_are_kept(tmp_path):
    """checkpoint.keep=2 (Lightning keeps k > 1 only by a metric: the step) keeps the two newest
    step checkpoints, last.ckpt linking to the newest; a keep below -1 is named."""
    train(compose(["model=tiny", *RUN, "trainer.max_steps=4", "checkpoint.keep=2", f"output_dir={tmp_path}"]))
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.glob("step-*.ckpt")) == ["step-3.ckpt", "step-4.ckpt"]
    assert (folder / "last.ckpt").resolve().name == "step-4.ckpt"
    with pytest.raises(ConfigError, match=r"checkpoint.keep=-2 is out of range: allowed \[-1, inf\]"):
        train(compose(["model=tiny", *RUN, "checkpoint.keep=-2", f"output_dir={tmp_path}/b"]))
