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

A layer with LoRA adapters (peft's ``lora.Linear``, model.lora) is packed merged: its packed
copy is ``W + (alpha / rank) B A`` (peft's ``get_delta_weight``), so decoding multiplies once
per layer and token, as without adapters, instead of ``W x + B (A x)`` in three products.
The model itself is untouched (no merge into ``W``, nothing to undo); the merged product
equals the adapted one to float rounding. Layers whose adapters are off, already merged, or a
variant (DoRA, adapter biases, several active adapters) keep their own forward. Where nothing
is packed (a GPU rollout, or packing off), ``merge_lora`` still runs each LoRA layer on a plain
merged copy: one product per layer and token, at the cost of one more copy of the adapted
weights while the rollout lasts (measured on a GPU: unmerged, decoding ran at 0.37x-0.47x of
full fine-tuning's speed).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from ..lora import lean_forward

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


def _can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and packing_available(weight.dtype)


def packable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a plain CPU ``nn.Linear`` whose weight this build can pack."""
    # Exactly nn.Linear: subclasses (quantized, LoRA-wrapped) may compute something else.
    if type(module) is not torch.nn.Linear or "forward" in module.__dict__:
        return False
    w = module.weight
    return type(w) in (torch.nn.Parameter, torch.Tensor) and _can_pack(w)


def _own_forward(module: torch.nn.Module) -> bool:
    """Whether a LoRA layer computes what peft's class does: no instance forward, or the lean
    one of :mod:`ngrpo_lightning.lora` (same values)."""
    forward = module.__dict__.get("forward")
    return forward is None or getattr(forward, "__func__", None) is lean_forward


def _lora_adapter(module: torch.nn.Module) -> str | None:
    """The one plain active adapter of a peft LoRA linear layer that can run merged, else ``None``."""
    base = getattr(module, "base_layer", None)
    if type(base) is not torch.nn.Linear or not hasattr(module, "get_delta_weight") or module.disable_adapters:
        return None
    active = [name for name in module.active_adapters if name in module.lora_A]
    if module.merged or len(active) != 1 or active[0] in getattr(module, "lora_variant", {}):
        return None
    if getattr(module, "lora_bias", {}).get(active[0]) or not _own_forward(module):
        return None
    return active[0]


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows: int, enabled: bool = True, release=None, merge_lora: bool = False):
    """Within the block, ``model``'s linear layers multiply by a packed copy of their weights.

    ``rows``: the usual number of rows a product will have (the decoding batch), a hint for the
    layout. Use it where the weights do not change (no optimizer step, no autograd: the packed
    product has no backward). ``enabled=False`` packs nothing. ``merge_lora``: a LoRA layer
    that is not packed (packing off, or not on the CPU: a GPU rollout) still multiplies once,
    by a plain merged copy ``W + scale B A``, instead of three products per token. ``release(layer)``,
    if given, is called once a plain linear layer's weight is packed: a frozen model whose
    weights are read back from a file for each pass frees the plain copy there
    (:func:`~ngrpo_lightning.file_weights.weight_releaser`), so the pass holds one copy of each
    weight, not two. Yields the number of layers changed."""
    layers, inside = [], set()  # inside: the linears of a merged LoRA layer (never called while merged)
    own = {}  # a layer's instance forward (lora's lean one), put back after
    try:
        for m in model.modules() if enabled or merge_lora else ():
            if id(m) in inside:
                continue
            adapter = _lora_adapter(m)
            if adapter is not None:
                w = m.base_layer.weight
                pack = enabled and _can_pack(w)
                if not (pack or merge_lora):
                    continue
                inside.update(id(sub) for sub in m.modules())
                weight, bias = w.detach() + m.get_delta_weight(adapter).detach().to(w.dtype), m.base_layer.bias
            elif enabled and packable(m):
                weight, bias, pack = m.weight.detach(), m.bias, True
            else:
                continue
            bias = None if bias is None else bias.detach()
            if pack:
                m_forward = functools.partial(
                    _packed_forward, torch.ops.mkldnn._reorder_linear_weight(weight, max(1, rows)), bias
                )
            else:
                m_forward = functools.partial(torch.nn.functional.linear, weight=weight, bias=bias)
            if "forward" in m.__dict__:
                own[m] = m.__dict__["forward"]
            m.forward = m_forward
            layers.append(m)
            if release is not None and adapter is None:
                del weight
                release(m)
        yield len(layers)
    finally:
        for m in layers:
            m.__dict__.pop("forward", None)
            if m in own:
                m.forward = own[m]
