"""peft's LoRA linear layer as a backend runs it: the same values, fewer temporaries, merged decoding.

:class:`LeanLoraLinear` is swapped in for peft's ``lora.Linear`` (the mixin in front of peft's
class, :mod:`.swap`); peft still sees its own layer. What changes:

- the training forward computes peft's ``base(x) + B(A(dropout(x))) * scale`` op for op, with
  the scaling and the sum done in place on tensors nothing else holds: two full-width temporaries
  fewer per adapted layer (the update's peak drops: docs/lora.md), the
  same bits forward and backward;
- adapters kept in float32 on a bfloat16 (or float16) model, peft's default, multiply in the
  model's dtype with their weights cast (``r x d``, small), as autocast would, rather than casting
  every activation to float32 and the sum back: peft's path made six full-width casts per adapted
  layer, the update 1.8x the operations of full fine-tuning's (about as many kernels, where a GPU
  step of a small model is launch-bound). The weights and their gradients stay float32; the
  adapter's output is rounded to the model's dtype before the sum, a rounding of the size of
  the sum's own (``tests/test_backends.py`` bounds it against peft's);
- inside a rollout (:func:`~.passes.packed_for_pass` with ``decoding``), the layer multiplies
  once per token by a merged copy ``W + (alpha / rank) B A`` (peft's ``get_delta_weight``), packed
  for oneDNN where its base layer packs, instead of three products (unmerged, decoding ran at
  well under full fine-tuning's speed: docs/lora.md). The model is not merged; the copy is
  dropped when the rollout ends, unless the rollout replays its decoding step from graphs
  (``keep``): then the copy keeps its storage from one rollout to the next, rewritten in place
  with the same values, so that graphs recorded on it stay valid (a copy made anew would move and
  have them recorded again every rollout). Layers whose adapters are off, already merged, or a
  variant (DoRA, adapter biases, several active adapters) keep peft's forward.
"""

from __future__ import annotations

import torch

from ngrpo_lightning.backends.linear import BackendLinear, pack, packed_linear
from ngrpo_lightning.backends.swap import swap


class LeanLoraLinear:
    """Mixin in front of peft's ``lora.Linear`` (see the module docstring)."""

    prefix = "Lean"
    why = "peft LoRA layer, its sum and scaling in place; a merged copy W + scale B A while decoding"
    _merged: tuple | None = None  # (weight or packed copy, bias, packed?) inside a rollout
    _kept: torch.Tensor | None = None  # the merged copy's storage, kept across rollouts (``keep``)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self._merged is not None and not args and not kwargs:
            weight, bias, packed = self._merged
            return packed_linear(x, weight, bias) if packed else torch.nn.functional.linear(x, weight, bias)
        peft_forward = super().forward
        if self.disable_adapters and not self.merged and not args and not kwargs:
            return self.base_layer(x)  # peft's forward with its adapters off, without its checks' Python
        if args or kwargs or self.disable_adapters or self.merged:
            return peft_forward(x, *args, **kwargs)
        active = [a for a in self.active_adapters if a in self.lora_A]
        if any(a in self.lora_variant or not self._casts_to(self.lora_A[a].weight.dtype, x.dtype) for a in active):
            return peft_forward(x, *args, **kwargs)
        result = self.base_layer(x)
        for a in active:  # linear keeps its input, not its output: both may change in place
            down = torch.nn.functional.linear(self.lora_dropout[a](x), self.lora_A[a].weight.to(x.dtype))
            up = torch.nn.functional.linear(down, self.lora_B[a].weight.to(x.dtype))
            result = result.add_(up.mul_(self.scaling[a]))
        return result

    @staticmethod
    def _casts_to(weights: torch.dtype, inputs: torch.dtype) -> bool:
        """Whether the adapter runs in the inputs' dtype: the same, or float32 weights on half inputs."""
        return weights == inputs or (weights == torch.float32 and inputs in (torch.bfloat16, torch.float16))

    def merge_adapter_name(self) -> str | None:
        """The one plain active adapter that can run merged, else ``None``."""
        base = self.base_layer
        if not isinstance(base, torch.nn.Linear) or self.disable_adapters or self.merged:
            return None
        active = [name for name in self.active_adapters if name in self.lora_A]
        if len(active) != 1 or active[0] in getattr(self, "lora_variant", {}):
            return None
        if getattr(self, "lora_bias", {}).get(active[0]):
            return None
        return active[0]

    def can_merge(self) -> bool:
        return self.merge_adapter_name() is not None

    def start_merged_pass(self, rows: int, keep: bool = False) -> bool:
        """Decode on a merged copy until :meth:`end_pass`; ``True`` if it does. ``keep``: the copy
        keeps its storage across passes (written in place; not packed)."""
        adapter = self.merge_adapter_name()
        if adapter is None:
            return False
        w = self.base_layer.weight.detach()
        delta = self.get_delta_weight(adapter).detach().to(w.dtype)
        bias = None if self.base_layer.bias is None else self.base_layer.bias.detach()
        if keep:
            kept = self._kept
            if kept is None or kept.shape != w.shape or kept.dtype != w.dtype or kept.device != w.device:
                kept = self._kept = torch.empty_like(w)
                torch._dynamo.mark_static_address(kept)  # a compiled step reads it in place
            self._merged = (torch.add(w, delta, out=kept), bias, False)
            return True
        weight = w + delta
        packs = isinstance(self.base_layer, BackendLinear) and self.base_layer.pack_once
        self._merged = (pack(weight, rows), bias, True) if packs else (weight, bias, False)
        return True

    def end_pass(self) -> None:
        self._merged = None


def lean_lora_layers(model: torch.nn.Module) -> int:
    """Swap every peft LoRA linear layer of ``model`` for :class:`LeanLoraLinear`; returns how many."""
    from peft.tuners.lora.layer import Linear

    layers = [m for m in model.modules() if isinstance(m, Linear) and not isinstance(m, LeanLoraLinear)]
    for m in layers:
        swap(m, LeanLoraLinear)
    return len(layers)
