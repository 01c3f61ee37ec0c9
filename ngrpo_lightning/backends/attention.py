"""``sdpa_gqa``: transformers' SDPA attention, with grouped KV heads read in place.

Given a padding mask, transformers' ``sdpa`` copies each key/value head once per query head of its group
(``repeat_kv``); PyTorch's CPU kernel takes grouped heads as they are (``enable_gqa=True``, same values and
gradients). On a GPU a decoding step stacks a group's query heads as queries of their KV head
(:func:`stacked_decoding_attention`), other passes run ``sdpa`` at a bounded set of widths (:mod:`.width_buckets`);
dropout, a position bias or returned weights get transformers' ``sdpa`` unchanged. On CPU a decoding step is two
float32 matmuls with a group's query heads stacked (:func:`grouped_attention`; the rollout's KV cache keeps float32,
:mod:`ngrpo_lightning.rollout.kv_cache`), short half-precision passes take the same matmuls at a flash kernel's
precision (:class:`HalfPrecisionAttention`, :func:`half_precision_products_pay`), long plain-causal padded passes
PyTorch's causal kernel (:func:`causal_attention`, :func:`causal_starts`). Each threshold is where it measured faster
(docs/measurements.md).

The CPU backend registers it as ``sdpa_gqa`` when it chooses it (:func:`register`, never at import);
``backend.attention`` can name any attention transformers knows instead (``sdpa``, ``eager``, ``flash_attention_2``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ngrpo_lightning.backends.memo import TensorMemo
from ngrpo_lightning.backends.width_buckets import attention_bias, bucket_width, bucketed_attention

NAME = "sdpa_gqa"


def sdpa_gqa_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    *,
    memo: TensorMemo | None = None,
    buckets: bool = True,
    **kwargs,
):
    """transformers' attention signature: query [B, H, Lq, d], key/value [B, H_kv, Lk, d]; returns ([B, Lq, H, d],
    None). ``memo``: keeps what is derived from the mask for the forward's other layers (:class:`SdpaGqaAttention`'s);
    without one, made at each call. ``buckets``: on a GPU, widths from a bounded set (``width_buckets``)."""
    special = kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
    special = special or kwargs.get("output_attentions", False) or (getattr(module, "training", False) and dropout)
    if query.device.type != "cpu" and not special and query.shape[-2] == 1 and attention_mask is not None:
        return stacked_decoding_attention(query, key, value, attention_mask, scaling, memo, buckets), None
    if special or (query.device.type != "cpu" and not buckets):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.device.type != "cpu":  # a GPU's attention plans per shape: a bounded set of widths
        return bucketed_attention(module, query, key, value, attention_mask, dropout, scaling, memo=memo, **kwargs)
    if query.shape[-2] == 1:  # a decoding step
        if attention_mask is not None:
            attention_mask = attention_mask[..., : key.shape[-2]]
        return grouped_attention(query, key, value, attention_mask, scaling, memo), None
    key, value = key.to(query.dtype), value.to(query.dtype)  # from a widened rollout cache: see kv_cache
    if attention_mask is None:  # no padding: transformers passes is_causal itself
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if half_precision_products_pay(query, key):
        return grouped_attention(query, key, value, attention_mask, scaling, memo), None
    starts = causal_starts(attention_mask, query.shape[-2], memo)
    if starts is not None:
        return causal_attention(query, key, value, starts, scaling).transpose(1, 2).contiguous(), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def stacked_decoding_attention(
    query, key, value, attention_mask, scaling=None, memo=None, buckets: bool = True
) -> torch.Tensor:
    """A decoding step (query [N, H, 1, d], key/value [N, H_kv, Lk, d], mask [N, 1, 1, >= Lk]) through PyTorch's
    kernel, a group's query heads stacked as queries of their KV head [N, H_kv, H / H_kv, d] so each key and value
    is read once. Returns [N, 1, H, d] in the query's dtype. Keys are read at their
    :func:`~.width_buckets.bucket_width` (each new length would be a new cuDNN plan), those past the mask masked
    out; the rollout's reserved cache gives views of that width (``Backend.kv_read_width``), other keys are padded
    by a copy. ``memo``: as :func:`sdpa_gqa_attention_forward`'s."""
    rows, heads, _, dim = query.shape
    stacked = query.reshape(rows, key.shape[1], heads // key.shape[1], dim)
    length = key.shape[-2]
    width = bucket_width(length) if buckets else length  # a static cache's length is one: read in place
    if width != length:  # a growing cache read at its length: padded to a width planned for
        key, value = F.pad(key, (0, 0, 0, width - length)), F.pad(value, (0, 0, 0, width - length))
    mask = attention_bias(attention_mask, length, 1, width, query.dtype, memo)  # [N, 1, 1, Lk]: every head and query
    out = torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous()


# Half-precision passes take the matmuls while a row's [H, Lq, Lk] is at most this many pairs (where PyTorch's
# kernel stopped being slower), in chunks of rows of about CHUNK_PAIRS pairs (the fastest chunk measured).
HALF_PRECISION_ROW_PAIRS_MAX = 2**18
CHUNK_PAIRS = 2**19
HALF_PRECISION = (torch.bfloat16, torch.float16)


def half_precision_products_pay(query, key) -> bool:
    """Whether a half-precision pass takes the matmuls (:func:`grouped_attention`): PyTorch's CPU bfloat16 backward
    is slower at short lengths."""
    if query.dtype not in HALF_PRECISION:
        return False
    return query.shape[1] * query.shape[2] * key.shape[2] <= HALF_PRECISION_ROW_PAIRS_MAX


def grouped_attention(query, key, value, attention_mask, scaling=None, memo=None) -> torch.Tensor:
    """Attention as batched matmuls with a group's query heads stacked in one product: query [N, H, Lq, d] at the last
    Lq key positions, key/value [N, H_kv, Lk, d] (H a multiple of H_kv), mask [N, 1, Lq, Lk] (boolean, True where a
    key is read, or additive). Returns [N, Lq, H, d] in the query's dtype; a query that reads no key gives 0, as
    PyTorch's kernel does. Scores and softmax are float32 at least; a half-precision query with keys of its dtype (a
    log-prob or training pass) takes :class:`HalfPrecisionAttention`, anything else (a decoding step against a float32
    cache) computes wholly in float32 at least. ``memo``: as :func:`sdpa_gqa_attention_forward`'s."""
    rows, heads, lq, dim = query.shape
    kv_heads = key.shape[1]
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(rows, kv_heads, heads // kv_heads * lq, dim)  # a group's heads as rows of one product
    mask = None if attention_mask is None else attention_mask[:, :, None]  # [N, 1, 1, Lq, Lk]: every head
    if query.dtype in HALF_PRECISION and key.dtype == query.dtype and lq > 1:
        bias = None if mask is None else score_bias(attention_mask, q.shape, torch.float32, memo)
        out = HalfPrecisionAttention.apply(q, key, value, bias, scale)
    else:
        work = torch.promote_types(query.dtype, torch.float32)
        probs = torch.softmax(_scores(q.to(work), key.to(work), mask, scale, one_query=lq == 1), -1)
        out = torch.matmul(probs, value.to(work))
    out = out.view(rows, heads, lq, dim).transpose(1, 2)
    if mask is not None and mask.dtype == torch.bool and lq > 1:  # a decoding row reads its own key
        empty = ~attention_mask.any(-1).transpose(1, 2)[..., None]  # [N, Lq, 1, 1]
        if bool(empty.any()):
            out = out.masked_fill(empty, 0.0)
    return out.to(query.dtype).contiguous()


def _scores(q, key, mask, scale: float, one_query: bool = False) -> torch.Tensor:
    """Masked scores [N, H_kv, G x Lq, Lk] of stacked queries ``q`` [N, H_kv, G x Lq, d] in their dtype; ``mask``
    [N, 1, 1, Lq, Lk] or None."""
    if one_query:  # a decoding step: keys times queries, which streams the keys in order (measured faster)
        scores = torch.matmul(key, q.transpose(-1, -2)).transpose(-1, -2).mul_(scale)
    else:
        scores = torch.matmul(q * scale, key.transpose(-1, -2))
    if mask is None:
        return scores
    rows, kv_heads, stacked, keys = scores.shape
    grouped = scores.view(rows, kv_heads, -1, mask.shape[-2], keys)
    if mask.dtype == torch.bool:  # the lowest finite value, not -inf: a padding query reads no key, and no NaN
        grouped = grouped.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        grouped = grouped + mask.to(scores.dtype)
    return grouped.view(rows, kv_heads, stacked, keys)


def score_bias(mask: torch.Tensor, stacked_shape, dtype: torch.dtype, memo: TensorMemo | None = None) -> torch.Tensor:
    """The mask [N, 1, Lq, Lk] (boolean or additive) as an additive bias [N, H_kv, group x Lq, Lk] of ``dtype``
    for stacked queries of ``stacked_shape`` [N, H_kv, group x Lq, d]: 0 where a key is read, the lowest finite
    value where not. Built once per forward where a ``memo`` keeps it."""
    rows, kv_heads, stacked, _ = stacked_shape
    lq, lk = mask.shape[-2:]

    def make() -> torch.Tensor:
        if mask.dtype == torch.bool:
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        else:
            bias = mask.to(dtype)
        return bias[:, :, None].expand(rows, kv_heads, stacked // lq, lq, lk).reshape(rows, kv_heads, stacked, lk)

    return make() if memo is None else memo.get(mask, ("score bias", kv_heads, stacked, dtype), make)


class HalfPrecisionAttention(torch.autograd.Function):
    """Half-precision attention as flash kernels compute it, on matmuls: scores and softmax in float32, probabilities
    rounded to the half dtype for the product with the values. Keeps only its inputs and recomputes the probabilities
    in backward, in chunks of about ``CHUNK_PAIRS`` query-key pairs. Stacked queries [N, H_kv, G, d], key/value
    [N, H_kv, Lk, d], ``bias`` [N, H_kv, G, Lk] (:func:`score_bias`) or None; returns [N, H_kv, G, d]."""

    @staticmethod
    def forward(ctx, q, key, value, bias, scale: float):
        ctx.save_for_backward(q, key, value)
        ctx.bias, ctx.scale = bias, scale
        out = torch.empty_like(q)
        for part in _row_chunks(q, key):
            probs = _probabilities(q[part], key[part], None if bias is None else bias[part], scale)
            torch.matmul(probs.to(q.dtype), value[part], out=out[part])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, key, value = ctx.saved_tensors
        grads = torch.empty_like(q), torch.empty_like(key), torch.empty_like(value)
        for part in _row_chunks(q, key):
            bias = None if ctx.bias is None else ctx.bias[part]
            for grad, chunk in zip(grads, _backward(q[part], key[part], value[part], bias, ctx.scale, grad_out[part])):
                grad[part] = chunk
        return *grads, None, None


def _backward(q, key, value, bias, scale: float, grad_out):
    """Gradients of :class:`HalfPrecisionAttention` for q, key and value, the probabilities recomputed."""
    probs = _probabilities(q, key, bias, scale)
    grad_value = torch.matmul(probs.to(q.dtype).transpose(-1, -2), grad_out)
    grad_probs = torch.matmul(grad_out.to(probs.dtype), value.to(probs.dtype).transpose(-1, -2))
    # softmax's backward: p * (dp - sum(p * dp)), the sum in float32 from the same p and dp
    grad_scores = probs.mul_(grad_probs.sub_((grad_probs * probs).sum(-1, keepdim=True))).mul_(scale).to(q.dtype)
    return torch.matmul(grad_scores, key), torch.matmul(grad_scores.transpose(-1, -2), q), grad_value


def _row_chunks(q, key) -> list[slice]:
    rows = q.shape[0]
    step = max(1, CHUNK_PAIRS // (q.shape[1] * q.shape[2] * key.shape[2]))
    return [slice(r, r + step) for r in range(0, rows, step)]


def _probabilities(q, key, bias, scale: float) -> torch.Tensor:
    """The softmax of the biased scores, float32 (float64 for float64 inputs), bias and scale inside the product."""
    rows, kv_heads, stacked, dim = q.shape
    work = torch.promote_types(q.dtype, torch.float32)
    q3 = q.to(work).reshape(-1, stacked, dim)
    k3 = key.to(work).reshape(-1, key.shape[-2], dim).transpose(1, 2)
    if bias is None:
        scores = torch.bmm(q3, k3).mul_(scale)
    else:
        scores = torch.baddbmm(bias.to(work).reshape(-1, stacked, k3.shape[-1]), q3, k3, alpha=scale)
    return torch.softmax(scores, -1).view(rows, kv_heads, stacked, -1)


def causal_starts(mask: torch.Tensor, queries: int, memo: TensorMemo | None = None) -> torch.Tensor | None:
    """:func:`causal_layout`'s starts where the causal kernel does less work than the masked one
    (:func:`causal_kernel_pays`); ``None`` otherwise. Checked once per forward where a ``memo`` keeps it."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return None

    def make() -> torch.Tensor | None:
        starts = causal_layout(mask, queries)
        pays = starts is not None and causal_kernel_pays(starts, *mask.shape[-2:])
        return starts if pays else None

    return make() if memo is None else memo.get(mask, "causal starts", make)


def causal_layout(mask: torch.Tensor, queries: int) -> torch.Tensor | None:
    """Where each row's keys start, [N], when the boolean ``mask`` [N, 1, Lq, Lk] is exactly causal attention
    over one unbroken run of keys per row (left padding, tokens, right padding; the queries the last Lq
    positions) and every row reads a key; ``None`` otherwise."""
    rows, _, lq, lk = mask.shape
    keys = mask[:, 0, -1]  # the last query reads every key of its row that is not padding
    flags = keys.int()
    start, end = flags.argmax(-1), lk - flags.flip(-1).argmax(-1)
    position = torch.arange(lk, device=mask.device)
    run = (position >= start[:, None]) & (position < end[:, None])
    causal = position[None] <= position[lk - lq :, None]  # [Lq, Lk], the queries at the last positions
    exact = torch.equal(keys, run) and torch.equal(mask[:, 0], causal[None] & run[:, None])
    return start if exact and bool(keys.any(-1).all()) else None


# PyTorch's CPU kernel skips the keys past the diagonal a block of this many keys at a time
CAUSAL_KEY_BLOCK = 512


def causal_kernel_pays(starts: torch.Tensor, queries: int, keys: int) -> bool:
    """Whether the causal kernel on rows shifted to their ``starts`` (:func:`causal_attention`) computes clearly
    fewer query-key pairs than the masked kernel's ``queries x keys`` per row. It reads keys up to the end of each
    ``CAUSAL_KEY_BLOCK``, so below one block it does more work; rows of different starts also pay for gathering,
    so they need a larger saving (docs/measurements.md)."""
    block = CAUSAL_KEY_BLOCK
    lengths = keys - starts.double()
    full = torch.div(lengths, block, rounding_mode="floor")
    causal = block * block * full * (full + 1) / 2 + (lengths - block * full) * lengths
    one_start = bool((starts == starts[0]).all())
    return float(causal.sum()) < (0.95 if one_start else 0.8) * len(starts) * queries * keys


def causal_attention(query, key, value, starts: torch.Tensor, scaling=None) -> torch.Tensor:
    """Causal attention with PyTorch's causal kernel (skips pairs above the diagonal): query [N, H, Lq, d] at the
    last Lq key positions, key/value [N, H_kv, Lk, d], row r's keys starting at ``starts[r]``. Each row is shifted
    left by its start, positions before the queries get zero queries whose outputs are dropped. Returns
    [N, H, Lq, d]; padding queries give 0."""
    rows, heads, lq, dim = query.shape
    lk = key.shape[-2]
    first = int(starts[0])
    if bool((starts == first).all()):  # one start for every row (rows of one prompt): views of the keys
        extra = lk - first - lq  # zero queries before the first query (negative: padding queries, dropped)
        q = torch.cat([query.new_zeros(rows, heads, extra, dim), query], 2) if extra > 0 else query[:, :, -extra:]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, key[:, :, first:], value[:, :, first:], is_causal=True, scale=scaling, enable_gqa=True
        )
        return out[:, :, extra:] if extra >= 0 else torch.nn.functional.pad(out, (0, 0, -extra, 0))
    if lk > lq:
        query = torch.cat([query.new_zeros(rows, heads, lk - lq, dim), query], 2)
    index = (torch.arange(lk, device=key.device) + starts[:, None]).clamp_(max=lk - 1)
    shift = lambda x: x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, dim))
    out = torch.nn.functional.scaled_dot_product_attention(
        shift(query), shift(key), shift(value), is_causal=True, scale=scaling, enable_gqa=True
    )
    # position j of a row (before the shift) is output j - start of the shifted row
    back = torch.arange(lk - lq, lk, device=key.device) - starts[:, None]  # [N, Lq]
    out = out.gather(2, back.clamp(min=0)[:, None, :, None].expand(-1, heads, -1, dim))
    return out.masked_fill((back < 0)[:, None, :, None], 0.0)


class SdpaGqaAttention:
    """What :func:`register` gives transformers as ``sdpa_gqa``: :func:`sdpa_gqa_attention_forward` with a memo."""

    def __init__(self):
        self.memo = TensorMemo()
        self.buckets = True  # the width_buckets speed-up: set by the backend that registers it

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        return sdpa_gqa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, memo=self.memo, buckets=self.buckets, **kwargs
        )


def register(buckets: bool = True) -> str:
    """Make ``sdpa_gqa`` known to transformers (``AttentionInterface``, with ``sdpa``'s mask builder) before a
    model loads with it. Idempotent; ``buckets``: a GPU's widths bounded (``width_buckets``). Returns the name."""
    if not isinstance(AttentionInterface().get(NAME), SdpaGqaAttention):
        AttentionInterface.register(NAME, SdpaGqaAttention())
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    AttentionInterface().get(NAME).buckets = buckets
    return NAME


def known_attentions() -> list[str]:
    """The attention implementations a model can be loaded with here."""
    return sorted({"eager", NAME, *AttentionInterface().valid_keys()})


def check_attn_implementation(name, key: str = "backend.attention") -> None:
    """``name`` is an attention transformers knows, ``sdpa_gqa``, or a hub kernel (``owner/repo``);
    otherwise a ``ValueError`` naming ``key`` and the allowed names."""
    known = known_attentions()
    if isinstance(name, str) and (name in known or "/" in name):
        return
    raise ValueError(f"{key}={name!r} is not an attention transformers knows: allowed auto, {', '.join(known)}")
