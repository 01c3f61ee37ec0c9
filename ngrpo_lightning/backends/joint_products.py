"""Training passes that multiply a group of projections reading one input as one product.

Where the CUDA backend joined an attention's q, k, v or a gated MLP's gate, up as row blocks of one tensor
(:func:`~.joined.join_weights`), the policy's log-prob passes and update multiply each group once
(:class:`JointLinear` for plain layers, :class:`JointLoraProduct` for LoRA on frozen base weights); each parameter
still gets its own gradient. Whether a group can is decided once (:class:`TrainingJoin`); each pass only checks that
nothing moved, a few attribute reads per group, since a small model's GPU update waits on its host.
"""

from __future__ import annotations

import torch

from ngrpo_lightning.backends.linear import plain_linear
from ngrpo_lightning.backends.lora import LeanLoraLinear, base_plus_adapter, frozen_product, product_in
from ngrpo_lightning.compat.torch import has_forward_hooks, tensor_version


def rows_of_one_tensor(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose consecutive row blocks ``tensors`` are, in order (a view, no copy), or ``None``."""
    first = tensors[0].detach()
    if any(not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:] for t in tensors):
        return None
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for t in tensors:
        if t.device != first.device or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


class TrainingJoin:
    """What a training pass multiplies for ``projections`` on inputs of ``dtype``, decided once: ``kind`` ``"plain"``
    (:class:`JointLinear`), ``"lora"`` (:class:`JointLoraProduct`) or ``None`` (apart); :meth:`holds` says whether it
    still stands. LoRA layers are judged whatever their adapters' state, which :meth:`__call__` reads per pass."""

    def __init__(self, projections: tuple, dtype: torch.dtype):
        self.projections, self.dtype, self.kind = projections, dtype, None
        self.weight = self.bias = None
        self.adapters: list[tuple] = []
        self.params: list[torch.Tensor] = []
        self.lora = lora = all(isinstance(p, LeanLoraLinear) for p in projections)
        layers = [p.base_layer for p in projections] if lora else list(projections)
        if lora:  # the adapters whatever their state now (the reference's pass turns them off)
            self.active = [p.active_adapter for p in projections]
            parts = [p.adapter_weights(dtype) for p in projections]
            usable = all(part is not None and type(part[4]) is torch.nn.Identity for part in parts)
            if not usable or any(p.merged_adapters for p in projections):
                layers = []
            self.adapters = [part[:4] for part in parts] if layers else []  # (name, A, B, scale) per layer
        plain = layers and all((frozen_product(b) if lora else plain_linear(b, every_pass=True)) for b in layers)
        biases = [b.bias for b in layers] if plain else []
        if plain and all((b is None) == (biases[0] is None) for b in biases):
            self.weight = rows_of_one_tensor([b.weight for b in layers])
            self.bias = None if biases[0] is None else rows_of_one_tensor(biases)
            if self.weight is not None and (biases[0] is None or self.bias is not None):
                self.kind = "lora" if lora else "plain"
                self.params = [b.weight for b in layers] + ([] if biases[0] is None else biases)
        if self.kind == "lora":
            self.trained = [a[1] for a in self.adapters] + [a[2] for a in self.adapters]  # the A's, then the B's
            self.scales = [a[3] for a in self.adapters]
            self.alpha = self.scales[0] if len(set(self.scales)) == 1 else None  # one scale: the products apply it
            self.params += self.trained
        self.addresses = [t.data_ptr() for t in self.params]
        self.cast_key, self.down, self.blocks = None, None, None

    def holds(self, projections: tuple, dtype: torch.dtype) -> bool:
        """Whether the decision still stands: the same layers and dtype, no hook added, every parameter where it was,
        and (LoRA) the same active adapters, none merged (plain loops: it runs per group and pass)."""
        if dtype != self.dtype or projections != self.projections:
            return False
        for p in projections:
            if has_forward_hooks(p):
                return False
        if self.lora:
            for p, active in zip(projections, self.active):
                if p.active_adapter != active or p.merged_adapters:
                    return False
        for t, address in zip(self.params, self.addresses):
            if t.data_ptr() != address:
                return False
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The group's outputs side by side, or ``None`` (run them apart)."""
        if self.kind is None:
            return None
        if self.kind == "lora":
            return self._lora(x)
        if not torch.is_grad_enabled():
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if torch.is_autocast_enabled(x.device.type):  # the products' dtypes are autocast's: run them apart
            return None
        return JointLinear.apply(x, self.weight, self.bias, len(self.projections), *self.params)

    def _lora(self, x: torch.Tensor) -> torch.Tensor | None:
        off = [p.disable_adapters for p in self.projections]
        if all(off):  # the base model (the reference's pass): one product of the joined base weights
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if any(off) or torch.is_autocast_enabled(x.device.type):
            return None
        key = [tensor_version(a) for a in self.trained]
        if key != self.cast_key:  # the adapters changed (an optimizer step): cast and stack them again
            with torch.inference_mode(False), torch.no_grad():
                # the layers' own cast copies (adapters_in), which the rollout's merging made already
                casts = [p.adapters_in(a[0], self.dtype, a[1], a[2]) for p, a in zip(self.projections, self.adapters)]
                self.down = torch.cat([c[0] for c in casts])
                if self.alpha is not None:
                    scaled = [c[1] for c in casts]
                else:  # several scales: each B scaled in float32, rounded once
                    scaled = [(a[2].detach() * a[3]).to(self.dtype) for a in self.adapters]
                self.blocks = torch.block_diag(*scaled)
            self.cast_key = key
        alpha = 1.0 if self.alpha is None else self.alpha
        return JointLoraProduct.apply(
            x, self.weight, self.bias, self.down, self.blocks, self.scales, alpha, *self.trained
        )


class JointLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` where ``weight`` (and ``bias``) are the row blocks of the ``blocks`` layers'
    parameters given after them, each block's gradient (its rows of one product) going to its own parameter."""

    @staticmethod
    def forward(ctx, x, weight, bias, blocks, *params):
        ctx.save_for_backward(x, weight)
        ctx.sizes, ctx.has_bias = [p.shape[0] for p in params[:blocks]], bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        needs, blocks = ctx.needs_input_grad, len(ctx.sizes)
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = torch.mm(g, weight).view(x.shape) if needs[0] else None
        grad_w = [None] * blocks
        if any(needs[4 : 4 + blocks]):
            rows = torch.mm(g.t(), x.reshape(-1, x.shape[-1])).split(ctx.sizes)
            grad_w = [r if n else None for r, n in zip(rows, needs[4 : 4 + blocks], strict=True)]
        grad_b = []
        if ctx.has_bias:
            grad_b = [None] * blocks
            if any(needs[4 + blocks :]):
                sums = g.sum(0).split(ctx.sizes)
                grad_b = [b if n else None for b, n in zip(sums, needs[4 + blocks :], strict=True)]
        return (grad_x, None, None, None, *grad_w, *grad_b)


class JointLoraProduct(torch.autograd.Function):
    """The LoRA layers that read one input (q, k, v; gate, up) as one node: ``linear(x, W, b)`` on their frozen base
    weights joined by rows, plus ``d = A x`` for their A's stacked by rows, plus ``alpha`` times ``d`` by their B's in
    one block-diagonal matrix (one scale for all: the cast B's; else each block ``scale B`` and ``alpha`` 1). Backward:
    ``grad_d = alpha g B``, the input's ``g W + grad_d A``, the A's from one product, each B's from its own.
    ``params``: the A's, then the B's."""

    @staticmethod
    def forward(ctx, x, weight, bias, down, blocks, scales, alpha, *params):
        out, d = base_plus_adapter(x, weight, bias, down, blocks, alpha)
        ctx.save_for_backward(x, d, down, blocks, weight)
        count = len(params) // 2
        ctx.scales, ctx.alpha, ctx.dtypes = scales, alpha, [p.dtype for p in params]
        ctx.ranks, ctx.widths = [a.shape[0] for a in params[:count]], [b.shape[0] for b in params[count:]]
        return out

    @staticmethod
    def backward(ctx, grad):
        x, d, down, blocks, weight = ctx.saved_tensors
        needs, count = ctx.needs_input_grad, len(ctx.ranks)
        g = grad.reshape(-1, grad.shape[-1])
        d2, x2 = d.view(-1, d.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x, grad_a, grad_b = None, [None] * count, [None] * count
        first = 7  # the A's, then the B's
        if needs[0] or any(needs[first : first + count]):
            grad_d = torch.addmm(d2, g, blocks, beta=0, alpha=ctx.alpha)  # each adapter's scale B g, side by side
            if needs[0]:
                grad_x = torch.mm(g, weight).addmm_(grad_d, down).view(x.shape)
            if any(needs[first : first + count]):
                rows = product_in(ctx.dtypes[0], grad_d.t(), x2).split(ctx.ranks)
                grad_a = [r if n else None for r, n in zip(rows, needs[first : first + count], strict=True)]
        outs, ranks = g.split(ctx.widths, dim=1), d2.split(ctx.ranks, dim=1)
        for i in range(count):
            if needs[first + count + i]:
                grad_b[i] = product_in(ctx.dtypes[count + i], outs[i].t(), ranks[i], ctx.scales[i])
        return (grad_x, None, None, None, None, None, None, *grad_a, *grad_b)
