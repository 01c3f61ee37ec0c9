"""Reading checkpoints as data: nothing in a checkpoint file runs when it is read.

A pickle can carry code. Every read of a checkpoint here goes through :func:`load_checkpoint`, which unpickles with
``torch.load(weights_only=True)`` (tensors, numbers, strings, lists, tuples, dicts); anything else is refused with one
line naming the file and what it holds. A distributed (FSDP2) checkpoint's ``.metadata`` is read by PyTorch with plain
``pickle``, so :class:`_MetadataUnpickler` reads it first, building only distributed-checkpoint records."""

from __future__ import annotations

import enum
import pickle
import re
from dataclasses import is_dataclass
from pathlib import Path, PurePath

import torch

from ngrpo_lightning.config import ConfigError

__all__ = ["UnsafeCheckpoint", "check_distributed_metadata", "load_checkpoint"]

META_FILE = "meta.pt"  # what Lightning writes beside the shards of a distributed checkpoint
DCP_METADATA = ".metadata"  # PyTorch's distributed checkpoint index, a plain pickle


class UnsafeCheckpoint(ConfigError):
    """A checkpoint holds something other than data (a class or function to call when read)."""


def load_checkpoint(path: str | Path, mmap: bool | None = None) -> dict:
    """The contents of a checkpoint file (or a distributed folder's ``meta.pt``), read with ``weights_only=True`` on
    the CPU; single files memory-mapped unless ``mmap=False``. Raises :class:`UnsafeCheckpoint` for a file holding
    anything but data, and :class:`~ngrpo_lightning.config.ConfigError` for one that cannot be read."""
    path = Path(path)
    if path.is_dir():
        check_distributed_metadata(path)
    file = path / META_FILE if path.is_dir() else path
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=not path.is_dir() if mmap is None else mmap)
    except pickle.UnpicklingError as err:  # what the weights-only unpickler refuses
        raise UnsafeCheckpoint(f"refused to read the checkpoint {file}: {_refused(err)}") from None
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file: the user's input problem
        raise ConfigError(f"cannot read the checkpoint {file}: {_first_line(err)}") from err


def check_distributed_metadata(folder: str | Path) -> None:
    """Refuse a distributed checkpoint whose ``.metadata`` would build anything but distributed-checkpoint records."""
    file = Path(folder) / DCP_METADATA
    if not file.is_file():
        return
    try:
        with open(file, "rb") as f:
            _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpoint(f"refused to read the checkpoint {folder}: {file.name} {err}") from None
    except Exception as err:  # noqa: BLE001
        raise ConfigError(f"cannot read the checkpoint {folder}: {file.name}: {_first_line(err)}") from err


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what a distributed checkpoint's index holds: ``torch.distributed.checkpoint``'s
    dataclasses and enums, ``torch.Size``, dtypes, layouts, memory formats, paths."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint"):
            found = super().find_class(module, name)
            if isinstance(found, type) and (is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        elif module == "torch":
            found = getattr(torch, name, None)
            if found is torch.Size or isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
        elif (module, name) == ("torch.serialization", "_get_layout"):
            return super().find_class(module, name)  # a layout from its name
        elif module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
            found = super().find_class(module, name)
            if issubclass(found, PurePath):
                return found
        elif (module, name) in (("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name} (code, not data); nothing of it was run")


# how torch's weights-only unpickler names what it refused (two wordings across torch releases)
_GLOBAL = re.compile(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)")


def _refused(err: Exception) -> str:
    """What the weights-only unpickler refused, in a few words."""
    found = _GLOBAL.search(str(err))
    if found:
        return f"it refers to {found[1]} (code, not data); nothing of it was run"
    return "it holds something other than data (tensors, numbers, strings and containers); nothing of it was run"


def _first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
