"""peft's LoRA linear layer as a backend runs it: the same values, fewer temporaries, merged decoding.

:class:`LeanLoraLinear` is a mixin in front of peft's ``lora.Linear`` (:mod:`.swap`); peft still sees its own layer.
Layers whose adapters are off, merged, or a variant (DoRA, adapter biases, several active) keep peft's forward.

- the training forward computes peft's ``base(x) + B(A(dropout(x))) * scale`` op for op, scaling and sum in place
  on tensors nothing else holds: two full-width temporaries fewer per adapted layer, the same bits;
- float32 adapters on a half model (peft's default) multiply in the model's dtype with their small weights cast
  (kept until their version counters move), as autocast would, in one autograd node (:class:`LoraProduct`;
  :class:`LoraLinearProduct` for a frozen plain base without dropout), float32 gradients straight out of the half
  products where the device can (:func:`product_in`). The sum is rounded once where peft rounds three times
  (``tests/test_lora_layer.py`` bounds the error);
- inside a rollout (:func:`~.passes.packed_for_pass` with ``decoding``) it multiplies by a merged copy
  ``W + (alpha / rank) B A``, packed where its base layer packs (docs/lora.md). The model is not merged; the copy is
  dropped when the rollout ends unless graphs replay it (``keep``: its storage kept, rewritten in place).
"""

from __future__ import annotations

import functools

import torch

from ngrpo_lightning.backends.packing import BackendLinear, pack, packed_linear, plain_linear
from ngrpo_lightning.backends.swap import swap
from ngrpo_lightning.compat.peft import adapter_parts
from ngrpo_lightning.compat.torch import mark_static_address, tensor_version


class LeanLoraLinear:
    """Mixin in front of peft's ``lora.Linear`` (see the module docstring)."""

    prefix = "Lean"
    why = "peft LoRA layer, its sum and scaling in place; a merged copy W + scale B A while decoding"
    _merged: tuple | None = None  # (weight or packed copy, bias, packed?) inside a rollout
    _kept: torch.Tensor | None = None  # the merged copy's storage, kept across rollouts (``keep``)
    _cast: tuple | None = None  # (A, B) in the model's dtype, for the key below
    _cast_key: tuple | None = None  # (adapter, dtype, A's and B's versions and addresses)
    # training-pass caches a rollout's step never reads (it multiplies by _merged): graphs need not be re-recorded
    not_read_in_rollouts = ("_cast",)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not args and not kwargs:
            if self._merged is not None:
                weight, bias, packed = self._merged
                return packed_linear(x, weight, bias) if packed else torch.nn.functional.linear(x, weight, bias)
            if self.disable_adapters and not self.merged_adapters:
                return self.base_layer(x)  # peft's forward with its adapters off, without its checks
            fused = self._fused_parts(x.dtype)
            if fused is not None:  # float32 adapters on a half model: one node, the sum inside the product
                base, dropout, down, up, A, B, scale = fused
                if type(dropout) is not torch.nn.Identity:
                    return LoraProduct.apply(base(x), dropout(x), down, up, A, B, scale)
                frozen = frozen_product(base)
                if frozen is not None:  # the base product in the node too: one gradient for x, not two summed
                    return LoraLinearProduct.apply(x, *frozen, down, up, A, B, scale)
                return LoraProduct.apply(base(x), x, down, up, A, B, scale)
        peft_forward = super().forward
        if args or kwargs or self.disable_adapters or self.merged:
            return peft_forward(x, *args, **kwargs)
        active = [a for a in self.active_adapters if a in self.lora_A]
        plain = [a not in self.lora_variant and not self.lora_bias.get(a) for a in active]  # peft's other kinds
        if not all(plain) or any(not self._casts_to(self.lora_A[a].weight.dtype, x.dtype) for a in active):
            return peft_forward(x, *args, **kwargs)
        result = self.base_layer(x)
        for a in active:  # linear keeps its input, not its output: both may change in place
            down = torch.nn.functional.linear(self.lora_dropout[a](x), self.lora_A[a].weight.to(x.dtype))
            up = torch.nn.functional.linear(down, self.lora_B[a].weight.to(x.dtype))
            result = result.add_(up.mul_(self.scaling[a]))
        return result

    def _fused_parts(self, dtype: torch.dtype) -> tuple | None:
        """What :class:`LoraProduct` multiplies for inputs of ``dtype`` (base layer, dropout, cast A and B, trained
        A and B, scale), or ``None`` where peft's forward or the loop in :meth:`forward` runs (adapters off or merged,
        else as :meth:`adapter_weights`)."""
        if self.disable_adapters or self.merged_adapters:
            return None
        adapter = self.adapter_weights(dtype)
        if adapter is None:
            return None
        name, A, B, scale, dropout = adapter
        down, up = self.adapters_in(name, dtype, A, B)
        return self.base_layer, dropout, down, up, A, B, scale

    def adapter_weights(self, dtype: torch.dtype) -> tuple | None:
        """``(adapter, A, B, scale, dropout)`` of the one plain active adapter, float32 on inputs of half ``dtype``
        (read by :func:`~ngrpo_lightning.compat.peft.adapter_parts`, past ``Module.__getattr__``), whether on, off or
        merged just now; else ``None`` (several active, a variant, an adapter bias, adapters already in ``dtype``)."""
        name = self.active_adapter
        if not isinstance(name, str):
            if len(name) != 1:
                return None
            name = name[0]
        parts = adapter_parts(self, name)
        if parts is None or name in self.lora_variant or self.lora_bias.get(name):
            return None
        A, B, dropout = parts
        if A.dtype == dtype or not self._casts_to(A.dtype, dtype):
            return None
        return name, A, B, self.scaling[name], dropout

    def adapters_in(self, adapter: str, dtype: torch.dtype, A=None, B=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``adapter``'s A and B (its weights, where the caller has them) in ``dtype``, without gradients, cast
        again only after either changed (their version counters)."""
        if A is None:
            A, B = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        key = (adapter, dtype, tensor_version(A), tensor_version(B), A.data_ptr(), B.data_ptr())
        if self._cast_key != key:
            with torch.inference_mode(False), torch.no_grad():  # usable by a pass with gradients later
                self._cast = (A.detach().to(dtype), B.detach().to(dtype))
            self._cast_key = key
        return self._cast

    @staticmethod
    def _casts_to(weights: torch.dtype, inputs: torch.dtype) -> bool:
        """Whether the adapter runs in the inputs' dtype: the same, or float32 weights on half inputs."""
        return weights == inputs or (weights == torch.float32 and inputs in (torch.bfloat16, torch.float16))

    def merge_adapter_name(self) -> str | None:
        """The one plain active adapter that can run merged, else ``None`` (a rollout asks each layer once)."""
        if not isinstance(self.base_layer, torch.nn.Linear) or self.disable_adapters:
            return None
        if self.merged_adapters:
            return None
        names = self.active_adapter
        adapters = self.lora_A
        active = [name for name in ([names] if isinstance(names, str) else names) if name in adapters]
        if len(active) != 1 or active[0] in getattr(self, "lora_variant", {}):
            return None
        if getattr(self, "lora_bias", {}).get(active[0]):
            return None
        return active[0]

    def can_merge(self) -> bool:
        return self.merge_adapter_name() is not None

    def start_merged_pass(self, rows: int, keep: bool = False) -> bool:
        """Decode on a merged copy until :meth:`end_pass`; ``True`` if it does. ``keep``: the copy keeps its
        storage across passes (written in place; not packed)."""
        adapter = self.merge_adapter_name()
        if adapter is None:
            return False
        base = self.base_layer
        w = base.weight.detach()
        bias = None if base.bias is None else base.bias.detach()
        kept = None
        if keep:
            kept = self._kept
            if kept is None or kept.shape != w.shape or kept.dtype != w.dtype or kept.device != w.device:
                kept = self._kept = torch.empty_like(w)
                mark_static_address(kept)  # a compiled step reads it in place
        weight = self.merged_weight(adapter, out=kept)
        if keep:
            self._merged = (weight, bias, False)
            return True
        packs = isinstance(self.base_layer, BackendLinear) and self.base_layer.pack_once
        self._merged = (pack(weight, rows), bias, True) if packs else (weight, bias, False)
        return True

    def merged_weight(self, adapter: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """``W + scale B A`` for ``adapter`` (from :meth:`merge_adapter_name`), what decoding multiplies by: in
        ``W``'s dtype from the cast adapters, into ``out`` where given (fan_in_fan_out Conv1D layers never merge)."""
        w = self.base_layer.weight.detach()
        A, B = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        down, up = self.adapters_in(adapter, w.dtype, A, B)
        return torch.addmm(w, up, down, alpha=self.scaling[adapter], out=out)

    def end_pass(self) -> None:
        self._merged = None


class LoraProduct(torch.autograd.Function):
    """``base + scale * B(A(x_a))`` written into ``base`` (the base layer's output, which nothing else holds) in
    one ``addmm``, A and B given twice: the trained parameters get the gradients, the cast copies multiply."""

    @staticmethod
    def forward(ctx, base, x_a, down, up, A, B, scale):
        d = torch.nn.functional.linear(x_a, down)
        base.view(-1, base.shape[-1]).addmm_(d.view(-1, d.shape[-1]), up.t(), alpha=scale)
        ctx.mark_dirty(base)
        ctx.save_for_backward(x_a, d, down, up)
        ctx.scale, ctx.dtypes = scale, (A.dtype, B.dtype)
        return base

    @staticmethod
    def backward(ctx, grad):
        x_a, d, down, up = ctx.saved_tensors
        needs = ctx.needs_input_grad
        g, grad_d, grad_A, grad_B = adapter_backward(ctx, grad, x_a, d, up, needs[1], needs[4], needs[5])
        grad_x = None if not needs[1] else torch.mm(grad_d, down).view(x_a.shape)
        return grad, grad_x, None, None, grad_A, grad_B, None


class LoraLinearProduct(torch.autograd.Function):
    """``linear(x, W, b) + scale * B(A(x))`` as one node, for a frozen plain base layer and no dropout:
    :class:`LoraProduct` with the base product inside, the adapter's share of ``x``'s gradient written into the
    base's in place. ``W`` and ``b`` get no gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, down, up, A, B, scale):
        out, d = base_plus_adapter(x, weight, bias, down, up, scale)
        ctx.save_for_backward(x, d, down, up, weight)
        ctx.scale, ctx.dtypes = scale, (A.dtype, B.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, d, down, up, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        g, grad_d, grad_A, grad_B = adapter_backward(ctx, grad, x, d, up, needs[0], needs[5], needs[6])
        grad_x = None if not needs[0] else torch.mm(g, weight).addmm_(grad_d, down).view(x.shape)
        return grad_x, None, None, None, None, grad_A, grad_B, None


def base_plus_adapter(x, weight, bias, down, up, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(x, weight, bias) + alpha * up(down(x)), down(x))``: the sum written into the base product."""
    out = torch.nn.functional.linear(x, weight, bias)
    d = torch.nn.functional.linear(x, down)
    out.view(-1, out.shape[-1]).addmm_(d.view(-1, d.shape[-1]), up.t(), alpha=alpha)
    return out, d


def adapter_backward(ctx, grad, x_a, d, up, needs_x: bool, needs_A: bool, needs_B: bool) -> tuple:
    """``(g, grad_d, grad_A, grad_B)`` for the output's gradient ``grad`` (``g``: its rows [M, out]), the adapter's
    input ``x_a`` and ``d = A x_a``: ``grad_d = scale g B`` (where ``x`` or ``A`` needs it), ``A``'s
    ``grad_d^T x_a`` and ``B``'s ``scale g^T d``, in the adapters' dtypes."""
    g = grad.reshape(-1, grad.shape[-1])
    d2 = d.view(-1, d.shape[-1])
    grad_d = grad_A = grad_B = None
    if needs_x or needs_A:
        grad_d = torch.addmm(d2, g, up, beta=0, alpha=ctx.scale)
        if needs_A:
            grad_A = product_in(ctx.dtypes[0], grad_d.t(), x_a.reshape(-1, x_a.shape[-1]))
    if needs_B:
        grad_B = product_in(ctx.dtypes[1], g.t(), d2, ctx.scale)
    return g, grad_d, grad_A, grad_B


def frozen_product(base: torch.nn.Module) -> tuple | None:
    """``(weight, bias)`` of ``base`` where its forward is ``F.linear`` on frozen weights (no hooks, no packed
    products, nothing trained), which :class:`LoraLinearProduct` may compute itself; else ``None``."""
    if not plain_linear(base) or base.weight.requires_grad:
        return None
    bias = base.bias
    return None if bias is not None and bias.requires_grad else (base.weight, bias)


@functools.cache
def writes_out_dtype(device_type: str, inputs: torch.dtype, output: torch.dtype) -> bool:
    """Whether this PyTorch's products on ``device_type`` write ``output`` from ``inputs`` themselves
    (``out_dtype``: CUDA products of half inputs). Asked once per device kind, on a small product."""
    try:
        one = torch.ones(1, 1, dtype=inputs, device=device_type)
        torch.addmm(torch.empty(1, 1, dtype=output, device=device_type), one, one, beta=0, alpha=0.5, out_dtype=output)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def product_in(dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``alpha * a @ b`` from half ``a`` and ``b``, in ``dtype`` (an adapter's float32 gradient): written in
    ``dtype`` by the product itself where the device can (:func:`writes_out_dtype`), else cast after."""
    if writes_out_dtype(a.device.type, a.dtype, dtype):
        out = torch.empty(a.shape[0], b.shape[1], dtype=dtype, device=a.device)  # beta=0: never read
        return torch.addmm(out, a, b, beta=0, alpha=alpha, out_dtype=dtype)
    if alpha == 1.0:
        return torch.mm(a, b).to(dtype)
    return torch.addmm(a.new_empty(()), a, b, beta=0, alpha=alpha).to(dtype)


def lean_lora_layers(model: torch.nn.Module) -> int:
    """Swap every peft LoRA linear layer of ``model`` for :class:`LeanLoraLinear`; returns how many."""
    from peft.tuners.lora.layer import Linear

    layers = [m for m in model.modules() if isinstance(m, Linear) and not isinstance(m, LeanLoraLinear)]
    for m in layers:
        swap(m, LeanLoraLinear)
    return len(layers)
