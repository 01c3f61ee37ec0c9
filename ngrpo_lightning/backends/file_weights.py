"""A frozen model's weights kept in a file between uses, in memory only while it runs.

The KL reference is a second copy of the policy's initial weights (0.54 GB for the packaged
model). A step reads it once, for the reference log-probs, and then holds it through the
update, whose activations make the step's peak. On a CPU run the reference's weights can live
in a file instead: :func:`frozen_copy_to_file` writes them once into the run's folder, keeps the
file open and unlinks it at once (nothing is left on disk once the process ends), and
:func:`materialized` reads them back into memory for the duration of a pass (from the page
cache: a fraction of a second for the packaged model) and frees them after. The freed blocks are what the
update's activations then use (the allocator keeps them in the process), so the
reference and the activations share memory in turn instead of adding up. The bytes are the
weights', so the reference log-probs are unchanged. Under memory pressure the OS may drop the
file from its cache and read it back from disk.

The CPU backend chooses it (:meth:`~ngrpo_lightning.backends.Backend.reference_in_file`): ``file``
for a CPU run without FSDP on Linux whose ``output_dir`` is on a disk, ``memory`` otherwise. On a
RAM-backed ``output_dir`` (tmpfs, ramfs) the file itself would be memory, so the weights stay in
memory there.
"""

from __future__ import annotations

import copy
import os
import sys
import uuid
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch

CHOICES = ("auto", "memory", "file")


RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def filesystem_type(folder: str | os.PathLike) -> str | None:
    """The type of the file system ``folder`` is (or would be created) on, from the mount
    table (Linux); ``None`` where it cannot be told."""
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
    """``memory`` or ``file`` for ``model.reference_weights=choice``, checked; ``folder`` is
    where the file would be written (``auto`` picks ``memory`` on a RAM-backed one)."""
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
    """Where each parameter of a frozen model lives in its (unlinked) file, and who holds it."""

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
                module._parameters[name] = param
        self.loaded = True

    def drop(self) -> None:
        for _, placeholder, owners in self.slots:
            for module, name in owners:
                module._parameters[name] = placeholder
        self.loaded = False

    def drop_one(self, module: torch.nn.Module, name: str) -> None:
        """Free one loaded parameter until the next load, unless another module shares it (a
        tied embedding is read as a weight, not through the packed layer)."""
        placeholder = self.sole.get((id(module), name))
        if placeholder is not None:
            module._parameters[name] = placeholder

    def __del__(self):
        try:
            os.close(self.fd)
        except (OSError, AttributeError, TypeError):  # at interpreter exit `os` may be gone already
            pass


_files: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # frozen model -> its _FileWeights


def frozen_copy_to_file(model: torch.nn.Module, folder: str | os.PathLike) -> torch.nn.Module:
    """A frozen copy of ``model`` whose weights live in a file written in ``folder`` (open and
    already unlinked). The copy holds its weights in memory on return; :func:`materialized`
    is the way to use it after :func:`release`. Buffers are copied as :func:`copy.deepcopy` does."""
    originals = {id(p): p for p in model.parameters()}
    # placeholders with the parameters' shapes and dtypes, on the CPU (so .to("cpu") and summaries
    # work), holding one element each; the forward pre-hook below refuses to run on them
    memo = {
        key: torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=False)
        for key, p in originals.items()
    }
    frozen = copy.deepcopy(model, memo)
    owners: dict[int, list] = {}
    for module in frozen.modules():
        for name, param in module._parameters.items():
            if param is not None:
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
    frozen.register_forward_pre_hook(_check_loaded)
    _files[frozen] = weights
    return frozen


def _check_loaded(model, args):
    if not _files[model].loaded:
        raise RuntimeError(
            "the frozen reference's weights are in their file between passes: run it inside "
            "file_weights.materialized(model)"
        )


def release(model: torch.nn.Module | None) -> None:
    """Free the in-memory weights of a model :func:`frozen_copy_to_file` made (else a no-op)."""
    weights = _files.get(model) if model is not None else None
    if weights is not None and weights.loaded:
        weights.drop()


def weight_releaser(model: torch.nn.Module | None):
    """For a model :func:`frozen_copy_to_file` made: a function ``release(module)`` that frees
    ``module.weight`` until the next load (for a layer that runs on a packed copy of it, see
    :func:`~ngrpo_lightning.backends.passes.packed_for_pass`); ``None`` for other models."""
    weights = _files.get(model) if model is not None else None
    if weights is None:
        return None

    def release(module: torch.nn.Module) -> None:
        # a layer packed for decoding only (the LM head) says that passes read its weight outside its forward
        if not getattr(module, "decode_only", False):
            weights.drop_one(module, "weight")

    return release


@contextmanager
def materialized(model: torch.nn.Module | None):
    """``model`` with its weights in memory inside the block (read back from its file if it has
    one and they were released), and released after it."""
    weights = _files.get(model) if model is not None else None
    if weights is None:
        yield model
        return
    if not weights.loaded:
        weights.load()
    try:
        yield model
    finally:
        weights.drop()
