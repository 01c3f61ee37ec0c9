"""Reducing a [N, L] matrix of per-token losses to one scalar.

How tokens are weighed is an algorithmic choice (DAPO, Dr. GRPO): ``token-mean`` weighs every token equally,
``seq-mean-token-mean`` every sequence (the original GRPO), ``seq-mean-token-sum`` sums each sequence and averages,
``seq-mean-token-sum-norm`` divides the total by N x a constant length (Dr. GRPO: no length bias)."""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", norm_length: int | None = None
) -> torch.Tensor:
    """Aggregate per-token ``values`` [N, L] over the tokens where ``mask`` is 1. ``norm_length`` is the constant of
    ``seq-mean-token-sum-norm`` (default: L, the padded length)."""
    mask = mask.to(values.dtype)
    masked = values * mask
    if mode == "token-mean":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.mean()
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).mean()
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (values.shape[0] * (norm_length or values.shape[-1]))
    raise ValueError(f"objective.loss_agg={mode!r} is unknown: allowed {list(AGGREGATIONS)}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked entries (a metric helper; 0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


# The helpers below stay on the device: ``values[mask].min()`` or ``if mask.any()`` would make the host wait mid-pass.
def masked_min(values: torch.Tensor, mask: torch.Tensor, empty: float = 0.0) -> torch.Tensor:
    """Minimum over masked entries (``empty`` when the mask is empty)."""
    mask = mask.bool()
    low = values.masked_fill(~mask, float("inf")).min()
    return torch.where(mask.any(), low, low.new_tensor(empty))


def masked_max(values: torch.Tensor, mask: torch.Tensor, empty: float = 0.0) -> torch.Tensor:
    """Maximum over masked entries (``empty`` when the mask is empty)."""
    mask = mask.bool()
    high = values.masked_fill(~mask, float("-inf")).max()
    return torch.where(mask.any(), high, high.new_tensor(empty))
