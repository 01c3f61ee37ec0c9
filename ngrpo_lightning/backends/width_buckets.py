"""Attention passes on a GPU at a bounded set of widths, so its attention library builds a bounded number of plans.

PyTorch's cuDNN attention (a GPU's kernel for masked passes) builds a plan, in host time, for each new shape and
direction, and a training run meets a new width at almost every pass (each cut to its rows' longest sequence,
:meth:`~ngrpo_lightning.rollout.batch.RolloutBatch.trim`). So a masked pass is padded, inside attention only, to
:func:`bucket_width` of its lengths; the linear layers keep the exact width. The result is the same: a padded key is
masked out of every real query's softmax, a padded query is cut from the output, so no gradient reaches it.
``benchmarks/harness.py widths`` measures a pass at new widths both ways.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from ngrpo_lightning.backends.memo import TensorMemo

# bucket_width's steps: relative above 1,024 positions (attention much of the work), absolute below (a small share)
SMALLEST_STEP = 64
STEPS_PER_DOUBLING = 16


def bucket_width(n: int) -> int:
    """The width a pass of ``n`` positions computes attention at: the next multiple of 64 up to 1,024, then the next
    of sixteen evenly spaced widths per doubling (300 -> 320, 1,000 -> 1,024, 5,000 -> 5,120). At most 63 positions
    or 6.25% more than ``n``."""
    if n <= SMALLEST_STEP:
        return SMALLEST_STEP if n > 0 else n
    below = 1 << ((n - 1).bit_length() - 1)  # the power of two below n
    step = max(SMALLEST_STEP, below // STEPS_PER_DOUBLING)
    return -(-n // step) * step


def bucketed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, *, memo=None, **kwargs):
    """transformers' ``sdpa`` attention (query [B, H, Lq, d], key/value [B, H_kv, Lk, d]; returns ([B, Lq, H, d],
    None)) at :func:`bucket_width` of Lq and Lk. Without a mask a pass is causal, padded only where queries and keys are
    the same positions; with one, padded keys are masked and padded queries read every key. Each KV head is copied
    straight into the padded width; the mask's bias is made once per forward where a ``memo`` keeps it
    (:func:`attention_bias`)."""
    lq, lk = query.shape[-2], key.shape[-2]
    wq, wk = bucket_width(lq), bucket_width(lk)
    if attention_mask is None:
        causal = kwargs.get("is_causal", getattr(module, "is_causal", True)) and lq == lk and lq > 1
        if not causal or wq == lq:  # nothing to pad, or not a causal pass over its own positions
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]
    if wq != lq:
        query = F.pad(query, (0, 0, 0, wq - lq))
    key, value = heads_at_width(key, groups, wk), heads_at_width(value, groups, wk)
    bias = None if attention_mask is None else attention_bias(attention_mask, lk, wq, wk, query.dtype, memo)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling, is_causal=attention_mask is None
    )
    return out[:, :, :lq].transpose(1, 2).contiguous(), None


def heads_at_width(t: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """Keys or values [B, H_kv, L, d] as [B, H_kv x groups, width, d]: each head once per query head of its group
    (transformers' ``repeat_kv``), the positions after L zero."""
    rows, heads, length, dim = t.shape
    if width == length:
        return repeat_kv(t, groups)
    out = t.new_zeros(rows, heads, groups, width, dim)
    out[:, :, :, :length] = t[:, :, None]
    return out.view(rows, heads * groups, width, dim)


def attention_bias(
    mask: torch.Tensor, lk: int, wq: int, wk: int, dtype: torch.dtype, memo: TensorMemo | None = None
) -> torch.Tensor:
    """``mask`` [B, 1, Lq or 1, Lm] for its first ``lk`` keys, at [B, 1, wq or 1, wk]: the new keys (and keys past a
    shorter mask) read by no real query, the new queries reading every key. A boolean mask becomes an additive bias of
    ``dtype`` (0 / -inf); an additive one keeps its dtype. Made once per forward where ``memo`` keeps it."""
    make = lambda: _bias(mask, lk, wq, wk, dtype)
    return make() if memo is None else memo.get(mask, ("bias", lk, wq, wk, dtype), make)


def _bias(mask: torch.Tensor, lk: int, wq: int, wk: int, dtype: torch.dtype) -> torch.Tensor:
    lq = mask.shape[-2]
    mask = mask[..., :lk]  # (keys past a shorter mask, a cache read at a wider width, are hidden too)
    if mask.dtype == torch.bool:
        mask = additive_mask(mask, dtype)
    if wk != mask.shape[-1]:  # -inf, below any masked score: a row that reads no key keeps its values
        mask = F.pad(mask, (0, wk - mask.shape[-1]), value=float("-inf"))
    if wq != lq and lq > 1:  # (one row, broadcast over the queries, serves new ones as it is)
        mask = F.pad(mask, (0, 0, 0, wq - lq), value=0.0)
    return mask


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True where a key is read) as an additive bias: 0 where read, -inf where not, in ``dtype``."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
