"""Linear layers on prepacked weights for a rollout on the CPU (oneDNN's blocked layout).

Decoding runs each linear layer on a few dozen rows at a time. For such a small product the
default CPU matmul spends much of its time re-laying out the weight on every call, and a
decoding step calls every layer once per token. oneDNN can lay a weight out once, in the
blocked format its kernels read directly, and the products on that copy are faster (figures in
docs/performance.md, "Where a CPU step's time went"). The weights change after every optimizer
step, so they are packed once per rollout (counted in its time) and the copies are dropped when it ends.

:func:`packed_linears` does that for every plain ``torch.nn.Linear`` of a model for the
length of a ``with`` block: the layer's forward reads the packed copy, nothing else changes
(hooks, bias, outputs to float rounding: a packed product sums in another order). It holds
one extra copy of those weights while it lasts, which is less than what the update that
follows holds for gradients. Where oneDNN's packing is missing (a CPU build without it, an
unsupported dtype) or the model is not on the CPU, it does nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def packing_available(dtype: torch.dtype) -> bool:
    """Whether this build packs ``dtype`` weights and its packed product agrees with ``F.linear``."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.randn(24, 16).to(dtype), torch.randn(3, 16).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 3)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return torch.allclose(out.float(), torch.nn.functional.linear(x, weight).float(), rtol=1e-2, atol=1e-2)
    except (RuntimeError, AttributeError) as err:  # no such op in this build, or not for this dtype
        log.debug("no packed linear weights for %s: %s", dtype, err)
        return False


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packable(module: torch.nn.Module) -> bool:
    # Exactly nn.Linear: subclasses (quantized, LoRA-wrapped) may compute something else.
    if type(module) is not torch.nn.Linear or "forward" in module.__dict__:
        return False
    w = module.weight
    return type(w) in (torch.nn.Parameter, torch.Tensor) and w.device.type == "cpu" and packing_available(w.dtype)


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows: int, enabled: bool = True):
    """Within the block, ``model``'s linear layers multiply by a packed copy of their weights.

    ``rows``: the usual number of rows a product will have (the decoding batch), a hint for the
    layout. Use it where the weights do not change (no optimizer step, no autograd: the packed
    product has no backward)."""
    layers = [m for m in model.modules() if _packable(m)] if enabled else []
    try:
        for m in layers:
            packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), max(1, rows))
            m.forward = functools.partial(_packed_forward, packed, None if m.bias is None else m.bias.detach())
        yield len(layers)
    finally:
        for m in layers:
            m.__dict__.pop("forward", None)
