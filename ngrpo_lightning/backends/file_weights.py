"""A frozen model's weights kept in a file between uses, in memory only while it runs.

The KL reference, read once per step for its log-probs, would otherwise sit in memory through the update, whose
activations make the step's peak. On a CPU run :func:`frozen_copy_to_file` writes its weights once into the run's
folder, keeps the file open and unlinks it (nothing is left on disk), and :func:`materialized` reads them back (from
the page cache) for a pass and frees them after: the reference and the update's activations share memory in turn.
The bytes are the weights', so the reference log-probs are unchanged.

The CPU backend chooses it (:meth:`~ngrpo_lightning.backends.Backend.reference_in_file`): ``file`` for a CPU run
without FSDP on Linux whose ``output_dir`` is on a disk (not tmpfs or ramfs), ``memory`` otherwise.
"""

from __future__ import annotations

import copy
import os
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch

CHOICES = ("auto", "memory", "file")


RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def filesystem_type(folder: str | os.PathLike) -> str | None:
    """The file system type ``folder`` is (or would be created) on, from the mount table (Linux); else ``None``."""
    path = Path(folder).resolve()
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return None
    best, kind = "", None
    for point, fs in mounts:
        point = point.replace("\\040", " ")
        inside = path == Path(point) or Path(point) in path.parents
        if inside and len(point) >= len(best):
            best, kind = point, fs
    return kind


def resolve(choice: str, accelerator: str, sharded: bool, folder: str | os.PathLike | None = None) -> str:
    """``memory`` or ``file`` for ``model.reference_weights=choice``, checked; ``folder`` is where the file would be
    written (``auto`` picks ``memory`` on a RAM-backed one)."""
    if choice not in CHOICES:
        raise ValueError(f"model.reference_weights={choice!r} is not one of {', '.join(CHOICES)}")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if choice == "file" and (sharded or not on_cpu):
        raise ValueError(
            "model.reference_weights=file reads the reference's weights from a file into host memory: it is for a "
            f"CPU run on one process (trainer.accelerator={accelerator}"
            f"{', sharded by trainer.parallel' if sharded else ''}); use memory or auto"
        )
    if choice == "auto":
        in_ram = folder is not None and filesystem_type(folder) in RAM_FILESYSTEMS
        return "file" if on_cpu and not sharded and sys.platform == "linux" and not in_ram else "memory"
    return choice


class _FileWeights:
    """Where each parameter of a :func:`frozen_copy_to_file` copy lives in its file, and who holds it."""

    def __init__(self, fd: int, slots: list):
        self.fd, self.slots, self.loaded = fd, slots, False  # slots: (offset, placeholder, [(module, name)])
        # a parameter that one module alone holds -> its placeholder (drop_one frees those only)
        self.sole = {(id(o[0][0]), o[0][1]): p for _, p, o in slots if len(o) == 1}

    def load(self) -> None:
        for offset, placeholder, owners in self.slots:
            param = torch.nn.Parameter(torch.empty(placeholder.shape, dtype=placeholder.dtype), requires_grad=False)
            view, done = memoryview(param.data.view(-1).view(torch.uint8).numpy()), 0
            while done < len(view):
                got = os.preadv(self.fd, [view[done:]], offset + done)
                if got <= 0:
                    raise OSError(f"the reference's weights file ended after {offset + done} bytes")
                done += got
            for module, name in owners:
                module.register_parameter(name, param)
        self.loaded = True

    def drop(self) -> None:
        for _, placeholder, owners in self.slots:
            for module, name in owners:
                module.register_parameter(name, placeholder)
        self.loaded = False

    def drop_one(self, module: torch.nn.Module, name: str) -> None:
        """Free one loaded parameter until the next load, unless another module shares it (a tied embedding)."""
        placeholder = self.sole.get((id(module), name))
        if placeholder is not None:
            module.register_parameter(name, placeholder)

    def check_loaded(self, model, args) -> None:
        """The model's forward pre-hook: its weights are in memory."""
        if not self.loaded:
            raise RuntimeError(
                "the frozen reference's weights are in their file between passes: run it inside "
                "file_weights.materialized(model)"
            )

    def __deepcopy__(self, memo):
        raise TypeError(
            "a model whose weights live in a file (file_weights.frozen_copy_to_file) cannot be copied: copy the "
            "model it was made from"
        )

    def __del__(self):
        try:
            os.close(self.fd)
        except (OSError, AttributeError, TypeError):  # at interpreter exit `os` may be gone already
            pass


def frozen_copy_to_file(model: torch.nn.Module, folder: str | os.PathLike) -> torch.nn.Module:
    """A frozen copy of ``model`` whose weights live in an unlinked file written in ``folder``, in memory on return;
    after :func:`release`, use it inside :func:`materialized`. Buffers are copied as :func:`copy.deepcopy` does."""
    originals = {id(p): p for p in model.parameters()}
    # placeholders with the parameters' shapes and dtypes, on the CPU, one element each; the pre-hook refuses them
    memo = {
        key: torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=False)
        for key, p in originals.items()
    }
    frozen = copy.deepcopy(model, memo)
    owners: dict[int, list] = {}
    for module in frozen.modules():
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append((module, name))
    path = Path(folder) / f".reference-weights-{uuid.uuid4().hex[:8]}"
    slots, offset = [], 0
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            for key, original in originals.items():
                placeholder = memo[key]
                data = original.detach().contiguous().view(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))
                slots.append((offset, placeholder, owners[id(placeholder)]))
                offset += data.numel()
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise OSError(
            f"could not write the frozen reference's weights ({offset / 2**30:.2f} GiB so far) to {path}: {err}; "
            "free space there or set output_dir to a folder with room (the CPU backend keeps the reference in a file "
            "in output_dir on a disk; on a RAM-backed output_dir it keeps it in memory)"
        ) from err
    finally:
        if os.path.lexists(path):
            path.unlink()  # the open descriptor keeps the data; no name is left behind
    weights = _FileWeights(fd, slots)
    weights.load()
    frozen.requires_grad_(False).eval()
    frozen.register_forward_pre_hook(weights.check_loaded)
    frozen.file_weights = weights  # the copy is this function's: what it holds goes with it
    return frozen


def _weights_of(model: torch.nn.Module | None) -> _FileWeights | None:
    """The file weights of a model :func:`frozen_copy_to_file` made, else ``None``."""
    weights = getattr(model, "file_weights", None) if model is not None else None
    return weights if isinstance(weights, _FileWeights) else None


def release(model: torch.nn.Module | None) -> None:
    """Free the in-memory weights of a model :func:`frozen_copy_to_file` made (else a no-op)."""
    weights = _weights_of(model)
    if weights is not None and weights.loaded:
        weights.drop()


def weight_releaser(model: torch.nn.Module | None):
    """For a :func:`frozen_copy_to_file` model, ``release(module)`` freeing ``module.weight`` until the next load (a
    layer on a packed copy, :func:`~ngrpo_lightning.backends.passes.packed_for_pass`); ``None`` for other models."""
    weights = _weights_of(model)
    if weights is None:
        return None

    def release(module: torch.nn.Module) -> None:
        # a layer packed for decoding only (the LM head) says that passes read its weight outside its forward
        if not getattr(module, "decode_only", False):
            weights.drop_one(module, "weight")

    return release


@contextmanager
def materialized(model: torch.nn.Module | None):
    """``model`` with its weights in memory inside the block (read back from its file if released), released after."""
    weights = _weights_of(model)
    if weights is None:
        yield model
        return
    if not weights.loaded:
        weights.load()
    try:
        yield model
    finally:
        weights.drop()
