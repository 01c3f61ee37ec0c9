"""Backends: one object decides how a run's models compute on its device (see :mod:`.base`).

backend = select_backend("auto", torch.float32)   # CPUBackend here, CUDABackend on a GPU
policy = load_policy(..., attn_implementation=backend.attention)
backend.prepare(policy, trains=True)              # modules swapped once, explicitly
describe(policy)                                  # per linear layer: its class and why
"""

from __future__ import annotations

import torch

from ngrpo_lightning.backends.base import BACKENDS, Backend
from ngrpo_lightning.backends.cpu import CPUBackend
from ngrpo_lightning.backends.cuda import CUDABackend
from ngrpo_lightning.backends.swap import describe

__all__ = [
    "BACKENDS",
    "Backend",
    "CPUBackend",
    "CUDABackend",
    "backend_class",
    "backend_for",
    "describe",
    "select_backend",
]


def device_type(accelerator: str) -> str:
    """``cpu`` or ``cuda`` for a Lightning ``trainer.accelerator`` (``auto``: a GPU if there is one)."""
    accelerator = str(accelerator or "auto")
    if accelerator in ("gpu", "cuda"):
        return "cuda"
    if accelerator == "auto" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def select_backend(name: str = "auto", dtype: torch.dtype = torch.float32, accelerator: str = "auto", **kwargs):
    """The backend ``backend.name`` asks for (``auto``: the one for ``accelerator``'s device)."""
    return backend_class(name, accelerator)(dtype, **kwargs)


def backend_class(name: str = "auto", accelerator: str = "auto") -> type[Backend]:
    """The class ``backend.name`` names (``auto``: the one for ``accelerator``'s device); one for another device
    than the run's is refused, naming those of the run's device."""
    device = device_type(accelerator)
    cls = BACKENDS.resolve(device if name in (None, "auto") else name)
    if cls.device_type != device:
        fitting = sorted(n for n, c in BACKENDS.items() if c.device_type == device)
        raise ValueError(
            f"backend.name={name!r} computes on {cls.device_type}, and this run on {device} "
            f"(trainer.accelerator={accelerator}): allowed auto or {fitting}"
        )
    return cls


def backend_for(model: torch.nn.Module) -> Backend:
    """The default backend of ``model``'s device and dtype, for a model no run built a backend for (a script, a
    benchmark). Nothing is measured or swapped until ``prepare(model)`` is called."""
    param = next(model.parameters())
    cls = CUDABackend if param.device.type == "cuda" else CPUBackend
    return cls(param.dtype)
