"""Writing checkpoints: streamed to disk, atomic, and (optionally) in a background thread.

Lightning's default writer serialises the checkpoint into memory first (two more copies).
:class:`StreamingCheckpointIO` streams ``torch.save`` into a temporary file renamed into place when complete, so a
killed save leaves the previous checkpoint intact and a full disk fails with one line
(:class:`~ngrpo_lightning.checkpoints.disk.DiskFull`); :class:`AtomicModelParallelStrategy` does the same for FSDP2's
folders. ``checkpoint.async_save=true`` writes on a thread while training goes on, holding a copy of every tensor
meanwhile (docs/checkpoints.md); tied tensors are copied once and stay tied."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from ngrpo_lightning.checkpoints.disk import DiskFull, disk_full
from ngrpo_lightning.compat import lightning as lightning_compat

__all__ = ["AtomicModelParallelStrategy", "BackgroundCheckpointIO", "StreamingCheckpointIO", "checkpoint_io", "relink"]

PARTIAL = ".partial"  # suffix of a checkpoint being written (a hidden file or folder beside the target)


def partial_path(target: Path) -> Path:
    """Where ``target`` is written before it is renamed into place."""
    return target.with_name(f".{target.name}{PARTIAL}")


class StreamingCheckpointIO(TorchCheckpointIO):
    """``torch.save`` streamed into a temporary file beside the target, renamed into place."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        fs, urlpath = fsspec.core.url_to_fs(str(path))
        if not isinstance(fs, LocalFileSystem):
            fs.makedirs(os.path.dirname(urlpath), exist_ok=True)
            with fs.transaction, fs.open(urlpath, "wb") as f:  # committed only when complete
                torch.save(checkpoint, f)
            return
        target = Path(urlpath)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = partial_path(target)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException as err:
            written = tmp.stat().st_size if tmp.exists() else 0  # before its space is freed
            full = disk_full(err, target, written) if isinstance(err, Exception) else None
            tmp.unlink(missing_ok=True)
            if full is not None:
                raise full from err
            raise


def copy_tensors(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with a copy of each tensor, taken now; tied tensors share one copy."""
    copies: dict[tuple, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, t.shape, t.stride())
        if key not in copies or t.numel() == 0:
            copies[key] = t.detach().clone()
        return copies[key]

    return apply_to_collection(checkpoint, torch.Tensor, copy)


class BackgroundCheckpointIO(AsyncCheckpointIO):
    """Lightning's ``AsyncCheckpointIO``: a copy of the checkpoint's tensors (:func:`copy_tensors`) written by a thread,
    in order; pending writes finish before a checkpoint is removed. The first failed write is raised by the next save,
    :meth:`wait` or the end, and links to its file point again at the last file written whole, or are removed."""

    _thread: ThreadPoolExecutor | None = None  # one worker: checkpoints are written in the order asked
    _failure: BaseException | None = None  # the first write that failed
    _written: str | None = None  # the last checkpoint written whole
    _failed: str | None = None  # the first one whose write failed, until its links are mended

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        self._raise_failure()  # a write failed meanwhile: the run stops on it, before another starts
        fs, urlpath = fsspec.core.url_to_fs(str(path))
        fs.makedirs(os.path.dirname(urlpath), exist_ok=True)  # now: ModelCheckpoint links last.ckpt into it at once
        copied = copy_tensors(checkpoint)  # on this thread: this step's values, whatever training does next

        def write() -> None:
            if self._failure is not None:
                return  # after a failure nothing more is written
            try:
                self.checkpoint_io.save_checkpoint(copied, path, storage_options)
                self._written = str(path)
            except BaseException as err:  # raised by the next save, by wait() or at the end
                self._failure, self._failed = err, str(path)

        if self._thread is None:  # made again after a teardown: a Trainer may fit or validate more than once
            self._thread = ThreadPoolExecutor(max_workers=1)
        self._thread.submit(write)

    def wait(self) -> None:
        """Return when every save asked for so far is on disk (the thread writes in order)."""
        if self._thread is not None:
            self._thread.submit(lambda: None).result()
        self._raise_failure()

    def remove_checkpoint(self, path) -> None:
        self.wait()
        super().remove_checkpoint(path)

    def teardown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is None:
            return
        if self._failed is not None:
            relink(Path(self._failed), Path(self._written) if self._written else None)
            self._failed = None
        raise self._failure


def relink(failed: Path, written: Path | None) -> None:
    """Links to ``failed`` (never written) in its folder point at ``written`` if there, else are removed; local only."""
    folder = failed.parent
    if not folder.is_dir():
        return
    for link in folder.iterdir():
        if link.is_symlink() and (folder / os.readlink(link)).resolve() == failed.resolve():
            link.unlink()
            if written is not None and written.parent == folder and written.is_file():
                os.symlink(written.name, link)


def checkpoint_io(async_save: bool = False):
    """The run's checkpoint writer: streamed and atomic, in a background thread with ``async_save``."""
    io = StreamingCheckpointIO()
    return BackgroundCheckpointIO(io) if async_save else io


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose distributed checkpoints are written to a temporary folder and swapped in once
    every rank is done; a failed save deletes it, a full disk is said in one line on every rank (:class:`DiskFull`)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if not lightning_compat.saves_distributed_checkpoint(self):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        target = Path(self.broadcast(str(filepath)))
        tmp, old = partial_path(target), target.with_name(f".{target.name}.old")
        if self.global_rank == 0:
            for leftover in (tmp, old):  # from a save that was killed
                shutil.rmtree(leftover, ignore_errors=True)
        self.barrier("ngrpo_checkpoint_start")
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
        except CheckpointException as err:  # raised on every rank together: the save reduces the ranks' results
            raise self._failed_save(err, target, tmp) from err
        self.barrier("ngrpo_checkpoint_written")
        if self.global_rank == 0:
            if target.is_symlink() or target.is_file():
                target.unlink()
            elif target.exists():
                target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        self.barrier("ngrpo_checkpoint_done")

    def _failed_save(self, err: CheckpointException, target: Path, tmp: Path) -> BaseException:
        """What a failed distributed save raises on every rank (a collective): :class:`DiskFull` where
        the disk is full, else ``err``; rank 0 decides before deleting the partial folder."""
        found = None
        if self.global_rank == 0:
            written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) if tmp.exists() else 0
            full = disk_full(err, target, written)
            found = (str(full), full.subject) if full is not None else None
            shutil.rmtree(tmp, ignore_errors=True)
        found = self.broadcast(found)
        return DiskFull(*found) if found else err
