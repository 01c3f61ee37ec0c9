"""Token sampling with temperature and the usual truncation filters (top-k, top-p, min-p).

Shared by every explorer, so an unmixed N-GRPO step is exactly a GRPO baseline step."""

from __future__ import annotations

import torch


def cumulative(probs: torch.Tensor) -> torch.Tensor:
    """``probs.cumsum(-1)`` for rows of a vocabulary's width, computed the fast way for the device. A GPU scans each
    row in long sequential stretches, a noticeable part of a large vocabulary's decoding step, so there rows are
    scanned in blocks of up to 1,024 tokens, each block's total added to the next (the same sums up to rounding). A
    CPU's ``cumsum``, and a width with no power-of-two factor >= 64, are kept."""
    width = probs.shape[-1]
    block = min(width & -width, 1024)  # the largest power of two dividing the width
    if probs.device.type != "cuda" or block < 64 or block == width:
        return probs.cumsum(-1)
    return blockwise_cumsum(probs, block)


def blockwise_cumsum(probs: torch.Tensor, block: int) -> torch.Tensor:
    """``probs.cumsum(-1)`` of rows [..., V] as sums within blocks (``block`` divides V) plus the blocks before."""
    local = probs.unflatten(-1, (-1, block)).cumsum(-1)
    before = torch.nn.functional.pad(local[..., -1].cumsum(-1)[..., :-1], (1, 0))
    return (local + before.unsqueeze(-1)).flatten(-2)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Return logits with filtered-out entries set to -inf. Inputs are B x V, already tempered."""
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        cutoff = min_p * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < cutoff, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = cumulative(sorted_logits.softmax(-1))
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample one token per row from ``softmax(filter(logits / temperature))``; greedy if temperature == 0.
    Inverse-CDF sampling, one uniform draw per row: exact, and on CPU much faster than ``torch.multinomial``."""
    if temperature == 0.0:
        return logits.argmax(-1)
    probs = filter_logits(logits.float() / temperature, top_k, top_p, min_p).softmax(-1)
    cdf = cumulative(probs)
    # u in (0, total]: the first index whose cdf reaches u has positive probability, never a filtered (zero-width) one
    u = (1.0 - torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device)) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
