"""The linear layer a backend swaps in: one class says what each product computes.

On some CPUs and shapes oneDNN multiplies faster by a weight reordered into its blocked layout (the CPU backend
measures which, :mod:`.cpu`), the same values to float rounding. Two ways use it:

- **packed once for a pass**: inside :func:`~.passes.packed_for_pass` (a rollout, the frozen reference's pass), where
  weights do not change and nothing needs a backward, a layer multiplies by one packed copy made when the pass starts
  and dropped when it ends (a file-backed reference frees each plain weight once packed); LoRA layers by their
  merged copy (:mod:`.lora`), packed when the base layer would be.
- **packed per product**: in the policy's log-prob passes and update, each product packs its operands as it runs
  (:class:`PackedLinearFunction`), forward and backward.
"""

from __future__ import annotations

import functools
import logging

import torch

from ngrpo_lightning.compat.torch import has_forward_hooks, linear_pointwise, reorder_linear_weight

log = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def packing_available(dtype: torch.dtype) -> bool:
    """Whether this build packs ``dtype`` weights and its packed product agrees with ``F.linear``."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.randn(24, 16).to(dtype), torch.randn(3, 16).to(dtype)
        out = packed_product(x, weight)
        return torch.allclose(out.float(), torch.nn.functional.linear(x, weight).float(), rtol=1e-2, atol=1e-2)
    except (RuntimeError, AttributeError) as err:  # no such op in this build, or not for this dtype
        log.debug("no packed linear weights for %s: %s", dtype, err)
        return False


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` [N, K] in oneDNN's blocked layout, for products of about ``rows`` rows."""
    return reorder_linear_weight(weight, max(1, rows))


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` on a weight :func:`pack` made."""
    return linear_pointwise(x, packed, bias)


def packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` [..., K] and ``weight`` [N, K], on a packed copy of ``weight``."""
    return packed_linear(x, pack(weight, x.numel() // x.shape[-1]), bias)


class PackedLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` with every product, forward and backward, on packed operands."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.has_bias = bias is not None
        y = packed_product(x, weight.detach(), None if bias is None else bias.detach())
        return y.detach()  # not a view of oneDNN's flat output: LoRA's layer adds to it in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = packed_product(grad.contiguous(), weight.detach().t().contiguous())
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            grad_w = packed_product(grad2.t().contiguous(), x2.t().contiguous())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad2.sum(0)
        return grad_x, grad_w, grad_b


class BackendLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose products the backend chose when it swapped the layer in. ``pack_once``: in a rollout
    (:func:`~.passes.packed_for_pass` decoding) multiply by one packed copy of the weight; ``pack_frozen``: the same in
    a frozen pass (the reference's log-probs); ``pack_per_product``: elsewhere, pack each product's operands as it
    runs. Otherwise ``F.linear``. ``why`` says why, in words."""

    prefix = "Backend"
    pack_once: bool = False
    pack_frozen: bool = False
    pack_per_product: bool = False
    # the LM head: packed for rollouts only (log-prob passes read its weight directly; a file never releases it)
    decode_only: bool = False
    why: str = ""
    _pass_weight: torch.Tensor | None = None  # the packed copy, inside a pass
    _in_pass: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._pass_weight is not None:
            return packed_linear(x, self._pass_weight, None if self.bias is None else self.bias.detach())
        if self.pack_per_product and not self._in_pass:
            return PackedLinearFunction.apply(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def end_pass(self) -> None:
        self._pass_weight, self._in_pass = None, False

    @classmethod
    def swap_in(
        cls,
        layer: torch.nn.Linear,
        pack_once: bool,
        pack_per_product: bool,
        why: str,
        decode_only: bool = False,
        pack_frozen: bool | None = None,
    ) -> BackendLinear:
        """Make the plain linear ``layer`` a :class:`BackendLinear` (``pack_frozen`` defaults to ``pack_once``)."""
        layer.__class__ = cls
        layer.pack_once, layer.pack_per_product, layer.why = pack_once, pack_per_product, why
        layer.pack_frozen = (pack_once if pack_frozen is None else pack_frozen) and not decode_only
        layer.decode_only = decode_only
        return layer


def plain_linear(layer: torch.nn.Module, every_pass: bool = False) -> bool:
    """Whether ``layer``'s forward is ``F.linear(x, layer.weight, layer.bias)`` and nothing else: an ``nn.Linear``
    without hooks, or a :class:`BackendLinear` multiplying by its weight as stored in the pass under way or, with
    ``every_pass``, in every pass (not packed for a rollout either)."""
    if not isinstance(layer, torch.nn.Linear) or has_forward_hooks(layer):
        return False
    forward = type(layer).forward
    if forward is BackendLinear.forward:
        packs_now = layer._pass_weight is not None or (layer.pack_per_product and not layer._in_pass)
        return not (packs_now or (every_pass and (layer.pack_once or layer.pack_per_product)))
    return forward is torch.nn.Linear.forward
