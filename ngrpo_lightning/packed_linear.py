"""The policy's linear layers on oneDNN-packed products during its log-prob passes (CPU).

On the CPU a plain ``F.linear`` multiplies by the weight as it is stored; oneDNN runs the same
product faster on a copy of the weight reordered into its blocked layout (rollouts already
decode on such copies, :mod:`~ngrpo_lightning.rollout.packed_weights`). The policy's weights
change at every optimizer step, so here each product packs its operand when it runs, which
costs a copy of the weight, far less than what the faster kernel saves at a training pass's
thousands of rows: forward ``y = x W^T`` on packed ``W``, and in backward ``dx = dy W`` on packed
``W^T`` and ``dW = dy^T x`` on packed ``x^T``. On the packaged model a training forward and
backward over 32 rows took 7.2 s with plain products and 5.3-5.7 s with these
(docs/performance.md). Values and gradients are equal to float rounding (another summation
order); the copies are transient, one layer's at a time.

:func:`packed_training` gives a model's plain ``nn.Linear`` layers this forward for the length
of a ``with`` block (``optim.packed_weights``): the update's forward and backward, and the
policy's own log-prob passes without autograd, so both compute the same numbers. Layers a
packing cannot serve or would slow keep their forward: other devices, dtypes other than float32
(bfloat16 products are as fast unpacked on a CPU with native bfloat16),
LoRA's rank-r matrices (packing them costs more than it saves) and the LM head
(the chunked log-probs read its weight directly).
"""

from __future__ import annotations

import contextlib

import torch

from .rollout.packed_weights import packable

# bfloat16 products run as fast unpacked on a CPU with native bfloat16 (AVX512-BF16): packed,
# the packaged model's update took 3.05 s against 2.65 (docs/performance.md); float32 gains 1.5x
DTYPES = (torch.float32,)


def _packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` [..., K] and ``weight`` [N, K], on a packed copy of ``weight``."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, x.numel() // x.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` with every product on packed operands."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.has_bias = bias is not None
        y = _packed_product(x, weight.detach(), None if bias is None else bias.detach())
        return y.detach()  # not a view of oneDNN's flat output: LoRA's layer adds to it in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _packed_product(grad.contiguous(), weight.detach().t().contiguous())
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            grad_w = _packed_product(grad2.t().contiguous(), x2.t().contiguous())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad2.sum(0)
        return grad_x, grad_w, grad_b


def packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return PackedLinearFunction.apply(x, self.weight, self.bias)


def _servable(module: torch.nn.Module) -> bool:
    return packable(module) and module.weight.dtype in DTYPES


def _adapter_matrices(model: torch.nn.Module) -> set[int]:
    """The ids of peft's LoRA ``A`` and ``B`` layers in ``model``."""
    return {
        id(sub)
        for m in model.modules()
        for name in ("lora_A", "lora_B")
        if isinstance(getattr(m, name, None), torch.nn.ModuleDict)
        for sub in getattr(m, name).modules()
    }


@contextlib.contextmanager
def packed_training(model: torch.nn.Module, enabled: bool = True):
    """Within the block, ``model``'s plain linear layers (the LM head aside) run
    :class:`PackedLinearFunction`; yields how many do. Backward may run inside or after it."""
    layers = []
    if enabled:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        skip = {id(head), *_adapter_matrices(model)}
        layers = [m for m in model.modules() if id(m) not in skip and _servable(m)]
    for m in layers:
        m.forward = packed_forward.__get__(m)
    try:
        yield len(layers)
    finally:
        for m in layers:
            m.__dict__.pop("forward", None)
