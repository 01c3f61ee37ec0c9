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

__all__ = ["BACKENDS", "Backend", "CPUBackend", "CUDABackend", "backend_for", "describe", "select_backend"]


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
    if name in (None, "auto"):
        name = device_type(accelerator)
    return BACKENDS.resolve(name)(dtype, **kwargs)


def backend_for(model: torch.nn.Module) -> Backend:
    """The backend of the device ``model`` is on, for what a rollout asks of it (its KV cache's
    dtype) where no run built one. Nothing is measured or swapped until ``prepare(model)`` is called
    (a script or benchmark that loads a model itself may call it, as a run does)."""
    param = next(model.parameters())
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None) or "auto"
    cls = CUDABackend if param.device.type == "cuda" else CPUBackend
    return cls(param.dtype, attention=attn)
