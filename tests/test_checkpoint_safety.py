"""Checkpoints are read as data: a checkpoint crafted to run code when unpickled is refused, in one
line naming the file and what it refers to, by every command that reads one (resume, eval, export),
and nothing of it runs. The project's own checkpoints of every kind (full, LoRA, sharded, with
rollouts ahead) are read by the same reader in the tests that write them (test_checkpoints,
test_lora, test_fsdp_cpu, test_rollouts_ahead, test_resume)."""

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from ngrpo_lightning.checkpoints.safe_load import UnsafeCheckpoint, check_distributed_metadata, load_checkpoint
from ngrpo_lightning.commands.cli import main
from ngrpo_lightning.config import compose


class _RunsCode:
    """Unpickling this calls ``os.system``: here, one that creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


RUN = ["model=tiny", "trainer.max_steps=2"]


def crafted_run(folder: Path, marker: Path) -> Path:
    """A run folder whose ``last.ckpt`` looks like the project's but carries a payload."""
    cfg = compose([*RUN, f"output_dir={folder}"])
    from omegaconf import OmegaConf

    meta = {"config": OmegaConf.to_container(cfg, resolve=True), "payload": _RunsCode(marker)}
    path = folder / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save({"global_step": 2, "state_dict": {"policy.w": torch.zeros(2)}, "ngrpo": meta}, path)
    return path


@pytest.mark.parametrize("command", ["resume", "eval", "export"])
def test_a_checkpoint_that_would_run_code_is_refused_unrun(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "it-ran"
    ckpt = crafted_run(tmp_path / "run", marker)
    argv = {
        "resume": ["train", *RUN, f"output_dir={tmp_path / 'run'}", "resume=last"],
        "eval": ["eval", f"model={tmp_path / 'run'}", "n=1"],
        "export": ["export", str(tmp_path / "run"), str(tmp_path / "hf")],
    }[command]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any(f"refused to read the checkpoint {ckpt}" in line and "posix.system" in line for line in err), err
    assert not any("Traceback" in line for line in err)
    assert not marker.exists()  # nothing of it ran
    assert not (tmp_path / "hf").exists()


def test_a_distributed_checkpoints_index_is_read_as_data_before_pytorch_opens_it(tmp_path):
    """PyTorch reads a sharded checkpoint's ``.metadata`` with plain pickle: a real one passes the
    check, a crafted one is refused before PyTorch (or Lightning) reads it."""
    import torch.distributed.checkpoint as dcp

    real = tmp_path / "real.ckpt"
    with pytest.warns(UserWarning, match="single process"):  # no process group here: as asked
        dcp.save({"state_dict": {"policy.w": torch.randn(3, 2).to(torch.bfloat16)}, "step": 3}, checkpoint_id=real)
    torch.save({"global_step": 3, "ngrpo": {}}, real / "meta.pt")
    assert load_checkpoint(real)["global_step"] == 3  # .metadata and meta.pt: data

    marker = tmp_path / "it-ran"
    crafted = tmp_path / "crafted.ckpt"
    shutil.copytree(real, crafted)
    with open(crafted / ".metadata", "wb") as f:
        pickle.dump(_RunsCode(marker), f)
    with pytest.raises(UnsafeCheckpoint, match=r"crafted\.ckpt: \.metadata refers to posix\.system"):
        check_distributed_metadata(crafted)
    with pytest.raises(UnsafeCheckpoint):
        load_checkpoint(crafted)
    assert not marker.exists()


def test_a_file_that_is_no_checkpoint_is_a_clear_error(tmp_path):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(Exception, match=f"cannot read the checkpoint {bad}"):
        load_checkpoint(bad)
