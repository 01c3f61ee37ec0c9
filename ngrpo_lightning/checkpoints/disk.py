"""Disk space: for a run's checkpoints, and one clear error wherever a write finds the disk full.

A run may keep several checkpoints (:func:`checkpoint_bytes`). When the disk fills, ``torch.save`` fails with
``unexpected pos ... vs ...``, naming neither cause nor file; safetensors and SQLite have errors of their own. So:

- :class:`DiskSpaceCheck` warns before the first step when ``output_dir``'s disk cannot hold the
  checkpoints the run will keep (an estimate: the run goes on);
- :func:`disk_full` turns a write that ran out of space into :class:`DiskFull`, one line naming the
  file, the space left and what is kept; :func:`no_space` tells any other write's error by its cause."""

from __future__ import annotations

import errno
import math
import shutil
import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from torch.distributed.tensor import DTensor

__all__ = ["DiskFull", "DiskSpaceCheck", "checkpoint_bytes", "disk_full", "no_space"]

NEARLY_FULL = 64 * 2**20  # bytes free below which a failed write is taken for a full disk
NO_SPACE = ("No space left on device", "database or disk is full")  # the OS's words, SQLite's


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**27 else f"{n / 2**20:.0f} MiB"


class DiskFull(OSError):
    """A write (checkpoint, export, MLflow store) failed on a full disk; its text names the file and what is intact."""

    def __init__(self, text: str, subject: str = ""):
        super().__init__(errno.ENOSPC, text)
        self.subject = subject or text  # what was not written: "checkpoint <path> was not written"

    def __str__(self) -> str:
        return self.strerror


def no_space(err: BaseException | None) -> bool:
    """Whether ``err`` or an exception it was raised from or during is 'no space left' (or a quota)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(words in str(err) for words in NO_SPACE):  # safetensors', SQLite's: their own error types
            return True
        err = err.__cause__ or err.__context__
    return False


KEPT = (
    "The checkpoints written before are unchanged: free space (or lower checkpoint.keep), then resume=last "
    "continues from the last one"
)


def disk_full(err: BaseException, target: Path, written: int, what: str = "checkpoint", kept: str = KEPT):
    """:class:`DiskFull` for a write of ``target`` (a ``what``) that failed with ``err`` after ``written`` bytes if the
    disk caused it (said by the error, or a nearly full disk), else ``None``; ``kept``: what is intact, what to do."""
    free = shutil.disk_usage(target.parent).free
    if not (no_space(err) or free < NEARLY_FULL):
        return None
    after = f" after {gib(written)} of it were written, now deleted" if written else ""
    subject = f"{what} {target} was not written"
    return DiskFull(f"{subject}: its disk is full ({gib(free)} free{after}). {kept}", subject)


def checkpoint_bytes(module: L.LightningModule) -> tuple[int, int]:
    """About what one checkpoint of ``module`` holds, in bytes: ``(weights, optimizer)``: its
    ``state_dict`` (shared tensors once) and AdamW's two moments per trainable weight."""
    weights, seen = 0, set()
    for t in module.state_dict().values():
        if isinstance(t, DTensor):  # a shard of each: all of it is written, by the ranks together
            weights += t.numel() * t.element_size()
        elif t.untyped_storage().data_ptr() not in seen:  # tied weights (embeddings, lm_head) are saved once
            seen.add(t.untyped_storage().data_ptr())
            weights += t.untyped_storage().nbytes()
    optimizer = sum(2 * p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return weights, optimizer


class DiskSpaceCheck(L.Callback):
    """Warns at fit setup when ``dirpath``'s disk has less free space than the checkpoints kept at once
    plus the one being written need. ``free_bytes``: the space to check against (default: the disk's)."""

    def __init__(
        self, dirpath: str | Path, every_n_steps: int = 0, keep: int = -1, best: bool = False, free_bytes=None
    ):
        self.dirpath = Path(dirpath)
        self.every_n_steps, self.keep, self.best = every_n_steps, keep, best
        self.free_bytes = free_bytes
        self.needed: int | None = None  # bytes, once estimated

    def kept(self, trainer: L.Trainer) -> int | None:
        """Checkpoint files kept at once (``None``: all, with no step limit)."""
        if not self.every_n_steps or self.keep == 0:
            steps = 1  # last.ckpt, a file
        elif self.keep > 0:
            steps = self.keep  # last.ckpt links to the newest
        elif trainer.max_steps is None or trainer.max_steps < 0:
            return None
        else:
            steps = math.ceil(trainer.max_steps / self.every_n_steps) + 1  # and the last step's
        return steps + int(self.best)

    @rank_zero_only
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # before the progress bar draws
            self.check(trainer, pl_module)

    def check(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Estimate what the checkpoints need (:attr:`needed`) and warn if the disk has less free."""
        weights, optimizer = checkpoint_bytes(pl_module)
        kept = self.kept(trainer)
        self.needed = ((kept or 1) + 1) * (weights + optimizer)  # + the one being written beside them
        where = next((p for p in (self.dirpath, *self.dirpath.parents) if p.exists()), Path("."))
        free = shutil.disk_usage(where).free if self.free_bytes is None else self.free_bytes
        if free >= self.needed:
            return
        many = {None: f"a checkpoint every {self.every_n_steps} steps, all", 1: "1 checkpoint"}.get(
            kept, f"up to {kept} checkpoints"
        )
        each = "" if kept == 1 else " each"
        warnings.warn(
            f"checkpoints in {self.dirpath}: its disk has {gib(free)} free, and this run keeps {many} of about "
            f"{gib(weights + optimizer)}{each} (weights {gib(weights)}, optimizer state {gib(optimizer)}), "
            f"{gib(self.needed)} with the one being written. A save that finds the disk full stops the run "
            "(the checkpoints before it are kept): free space, lower checkpoint.keep, or give output_dir= "
            "another disk",
            stacklevel=1,
        )
