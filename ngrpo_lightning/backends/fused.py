"""One fused kernel where transformers launches several: what a GPU's backend swaps in.

A small model's passes on a GPU wait on kernel launches, and a decoding step replayed from a
CUDA graph on the count of its kernels (about 2 us each, however little each one does).
transformers' Llama-style RMSNorm is eight kernels forward (the cast to float32, the square, the
mean, the epsilon, the reciprocal root, the scaling, the cast back, the weight) and about
twenty more in backward, twice per decoder layer. ``torch.nn.functional.rms_norm`` is one fused
kernel each way on CUDA. Measured on one H200 (docs/performance.md, "Fused norms"): 16.2 -> 5.0 us
per norm replayed in a graph at the packaged shape, forward and backward 0.82 -> 0.24 ms eagerly.

:class:`FusedRMSNorm` goes in front of a model's own norm class (:mod:`.swap`). The fused kernel
multiplies by the weight before it rounds to the model's dtype, where transformers rounds first
and multiplies in the model's dtype: in bfloat16 the two differ by one rounding of the output,
which every backend choice may (:mod:`.base`). A norm class is swapped only where its output
matches within that rounding on a random input (checked once per class), so norms that compute
something else (Gemma's ``1 + weight``) keep their own forward. It needs no recomputation: the
fused backward keeps the input and one reciprocal root per row, not the normalized copies
(:mod:`.recompute` then leaves these norms alone).
"""

from __future__ import annotations

import torch

from ngrpo_lightning.backends.swap import swap


class FusedRMSNorm:
    """Mixin in front of a Llama-style RMSNorm: ``torch.nn.functional.rms_norm``, one kernel."""

    prefix = "Fused"
    why = "torch's fused rms_norm: one kernel forward and one in backward on a GPU"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:  # transformers' promotion, e.g. float32 weights on half inputs
            return super().forward(hidden_states)
        return torch.nn.functional.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def _is_candidate(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and not weight.is_meta
        and getattr(type(module), "prefix", None) is None  # not already swapped by a backend
    )


def _matches(module: torch.nn.Module) -> bool:
    """Whether the fused norm gives ``module``'s own output up to one rounding, on a random input."""
    weight = module.weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 3, weight.shape[0], generator=gen).to(device=weight.device, dtype=weight.dtype)
    eps = max(torch.finfo(weight.dtype).eps, torch.finfo(torch.float32).eps)  # transformers' norms compute in float32
    try:
        with torch.no_grad():
            own, fused = type(module).forward(module, x), FusedRMSNorm.forward(module, x)
    except Exception:  # a module whose shape only looked familiar
        return False
    if own.shape != fused.shape or own.dtype != fused.dtype:
        return False
    return torch.allclose(own.float(), fused.float(), rtol=2 * eps, atol=eps)


def fused_modules(model: torch.nn.Module) -> int:
    """Swap ``model``'s Llama-style RMSNorms for :class:`FusedRMSNorm` where it gives their output
    up to rounding (checked once per class); returns how many were swapped."""
    checked: dict[type, bool] = {}
    count = 0
    for module in model.modules():
        if not _is_candidate(module):
            continue
        cls = type(module)
        if cls not in checked:
            checked[cls] = _matches(module)
        if checked[cls]:
            swap(module, FusedRMSNorm)
            count += 1
    return count
