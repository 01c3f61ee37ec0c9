"""``sdpa_gqa``: transformers' SDPA attention, with grouped KV heads read in place on CPU.

Models with grouped-query attention (SmolLM2, Qwen2, Llama 3: fewer key/value heads than
query heads) reach ``torch.nn.functional.scaled_dot_product_attention`` through transformers'
``sdpa`` attention. When a padding mask is given, which is every batched rollout and
log-prob pass here, transformers first copies each key/value head once per query head of its
group (``repeat_kv``), because CUDA's fast kernels need that. PyTorch's CPU kernel takes the
grouped heads as they are (``enable_gqa=True``) and gives the same values and gradients
without the copies: on the packaged model that is 60 copies of the KV cache per decoding step
and per forward. So on CPU this function passes ``enable_gqa``. On a GPU a decoding step stacks
the query heads of a group as queries of their KV head (:func:`stacked_decoding_attention`), and
every other pass is transformers' ``sdpa`` at a bounded set of widths (:mod:`.width_buckets`:
the GPU's attention library builds a plan per shape); attention with dropout, a position bias or
returned weights is transformers' ``sdpa`` unchanged anywhere.

A decoding step (one query per row) on CPU is two batched matmuls with the query heads of a
group stacked in one product (:func:`grouped_attention`): each key and value is read once
per group and in order, where the attention kernel reads them once per query head, and at long
contexts decoding is bound by reading the KV cache (all of it for every new token).
Half-precision steps compute in float32: PyTorch's CPU bfloat16 attention kernel was slower
than the float32 one at one query, and the rollout's KV cache keeps half-precision
keys and values in float32 for this function (:mod:`ngrpo_lightning.rollout.kv_cache`), so
nothing is cast per step. Short half-precision passes (log-probs and training at short
lengths, :func:`half_precision_products_pay`) take the same matmuls with the precision of a
flash kernel (float32 scores, :class:`HalfPrecisionAttention`): there PyTorch's bfloat16
kernel's backward was slower than the matmuls.

Long passes whose mask is plain causal attention over padded rows (log-prob passes and
training forwards of long responses) run PyTorch's causal kernel (:func:`causal_attention`).
Given a mask, the kernel computes every query-key pair and discards the masked ones, about half
of a causal pass's; with ``is_causal`` it skips them, but only in whole blocks of 512 keys, so
below about 600 keys per row the causal kernel does more work, not less. The mask and the
lengths are checked once per forward (:func:`causal_starts`); anything else (holes in a row,
shorter rows, a long cached prefix before a few queries) keeps the masked kernel. The
thresholds below come from timings kept in docs/performance.md ("Measurements behind the
code"), dated, with the machine.

The CPU backend registers it with transformers (``AttentionInterface``, with ``sdpa``'s mask
builder) as ``sdpa_gqa`` when it chooses it (:func:`register`, never at import) and loads models
with it; ``backend.attention`` can name any attention transformers knows instead (``sdpa``,
``eager``, ``flash_attention_2``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ngrpo_lightning.backends.width_buckets import attention_bias, bucket_width, bucketed_attention

NAME = "sdpa_gqa"


def sdpa_gqa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature: query [B, H, Lq, d], key/value [B, H_kv, Lk, d];
    returns ([B, Lq, H, d], None)."""
    special = kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
    special = special or kwargs.get("output_attentions", False) or (getattr(module, "training", False) and dropout)
    if query.device.type != "cpu" and not special and query.shape[-2] == 1 and attention_mask is not None:
        return stacked_decoding_attention(query, key, value, attention_mask, scaling), None
    if special:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.device.type != "cpu":  # a GPU's attention plans per shape: a bounded set of widths
        return bucketed_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[-2] == 1:  # a decoding step
        if attention_mask is not None:
            attention_mask = attention_mask[..., : key.shape[-2]]
        return grouped_attention(query, key, value, attention_mask, scaling), None
    key, value = key.to(query.dtype), value.to(query.dtype)  # from a widened rollout cache: see kv_cache
    if attention_mask is None:  # no padding: transformers passes is_causal itself
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if half_precision_products_pay(query, key):
        return grouped_attention(query, key, value, attention_mask, scaling), None
    starts = causal_starts(attention_mask, query.shape[-2])
    if starts is not None:
        return causal_attention(query, key, value, starts, scaling).transpose(1, 2).contiguous(), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def stacked_decoding_attention(query, key, value, attention_mask, scaling=None) -> torch.Tensor:
    """A decoding step (query [N, H, 1, d], key/value [N, H_kv, Lk, d], mask [N, 1, 1, >= Lk]) through
    PyTorch's attention kernel with the query heads of a group stacked as the queries of their KV
    head, [N, H_kv, H / H_kv, d]: each key and value is read once, where transformers, given a mask
    on a GPU, first copies them once per query head (``repeat_kv``: at the Qwen2.5-1.5B shape, 32
    rows on a static cache of 322 positions, 1.8 GB written and read back per decoding step, where
    the step's own floor is 3.3 GB read). The same products; returns [N, 1, H, d] in the query's dtype.
    Keys are read at their :func:`~.width_buckets.bucket_width`, those past the mask masked out:
    each new key length would be a new shape for cuDNN's attention to plan, at every step of eager
    decoding (the eager row of docs/performance.md's H100 table). The rollout's reserved cache
    gives views of that width (``Backend.kv_read_width``); other keys are padded by a copy."""
    rows, heads, _, dim = query.shape
    stacked = query.reshape(rows, key.shape[1], heads // key.shape[1], dim)
    length = key.shape[-2]
    width = bucket_width(length)  # a static cache's length is one: its keys are read in place
    if width != length:  # a growing cache read at its length: padded to a width planned for
        key, value = F.pad(key, (0, 0, 0, width - length)), F.pad(value, (0, 0, 0, width - length))
    mask = attention_bias(attention_mask, length, 1, width, query.dtype)  # [N, 1, 1, Lk]: every head and query
    out = torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous()


# Half-precision passes take the matmuls while a row's [H, Lq, Lk] is at most this many pairs
# (where PyTorch's kernel stopped being slower), in chunks of rows of about CHUNK_PAIRS pairs
# (2 MiB of float32 scores: the fastest chunk at every short shape timed; docs/performance.md).
HALF_PRECISION_ROW_PAIRS_MAX = 2**18
CHUNK_PAIRS = 2**19
HALF_PRECISION = (torch.bfloat16, torch.float16)


def half_precision_products_pay(query, key) -> bool:
    """Whether a half-precision pass computes attention as matmuls (:func:`grouped_attention`)
    rather than with PyTorch's kernel: on CPU the kernel's bfloat16 backward was slower than the
    matmuls at short lengths, and as fast from about 256 queries x 340 keys."""
    if query.dtype not in HALF_PRECISION:
        return False
    return query.shape[1] * query.shape[2] * key.shape[2] <= HALF_PRECISION_ROW_PAIRS_MAX


def grouped_attention(query, key, value, attention_mask, scaling=None) -> torch.Tensor:
    """Attention as batched matmuls with the query heads of a group stacked in one product:
    query [N, H, Lq, d] at the last Lq key positions, key/value [N, H_kv, Lk, d] (H a multiple
    of H_kv), mask [N, 1, Lq, Lk] (boolean, True where a key is read, or additive). Returns
    [N, Lq, H, d] in the query's dtype. A query that reads no key (a padding position) gives 0,
    as PyTorch's kernel does.

    Scores and softmax are float32 at least. A half-precision query with keys of its dtype (a
    log-prob or training pass) multiplies the probabilities and values in that dtype and keeps
    for backward what PyTorch's kernel keeps (:class:`HalfPrecisionAttention`); otherwise (a
    decoding step: one query, against a float32 cache) everything is float32 at least."""
    rows, heads, lq, dim = query.shape
    kv_heads = key.shape[1]
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(rows, kv_heads, heads // kv_heads * lq, dim)  # a group's heads as rows of one product
    mask = None if attention_mask is None else attention_mask[:, :, None]  # [N, 1, 1, Lq, Lk]: every head
    if query.dtype in HALF_PRECISION and key.dtype == query.dtype and lq > 1:
        bias = None if mask is None else score_bias(attention_mask, q.shape, torch.float32)
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
    """Masked scores [N, H_kv, group x Lq, Lk] of stacked queries ``q`` [N, H_kv, group x Lq, d]
    in their dtype; ``mask`` [N, 1, 1, Lq, Lk] or None."""
    if one_query:  # a decoding step: keys times queries, which streams the keys in order (57
        # against 84 ms per token at 1,000 cached positions)
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


def score_bias(mask: torch.Tensor, stacked_shape, dtype: torch.dtype) -> torch.Tensor:
    """The mask [N, 1, Lq, Lk] (boolean or additive) as an additive bias [N, H_kv, group x Lq, Lk]
    of ``dtype`` for the scores of stacked queries of ``stacked_shape`` [N, H_kv, group x Lq, d]:
    0 where a key is read, the lowest finite value where not. Built once per forward: it is
    kept on the mask, which every layer shares."""
    rows, kv_heads, stacked, _ = stacked_shape
    lq, lk = mask.shape[-2:]
    cache = mask.__dict__.setdefault("_ngrpo_score_bias", {})
    key = (kv_heads, stacked, dtype)
    if key not in cache:
        if mask.dtype == torch.bool:
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        else:
            bias = mask.to(dtype)
        cache[key] = bias[:, :, None].expand(rows, kv_heads, stacked // lq, lq, lk).reshape(rows, kv_heads, stacked, lk)
    return cache[key]


class HalfPrecisionAttention(torch.autograd.Function):
    """Half-precision attention as flash-attention kernels compute it, on matmuls: scores and
    softmax in float32, the probabilities rounded to the half dtype for the product with the
    values. Keeps for backward only its inputs, as a flash kernel does, and recomputes the
    probabilities there, so no [Lq, Lk] tensor is held between forward and backward. Works
    through the rows in chunks of about ``CHUNK_PAIRS`` query-key pairs. Stacked queries
    [N, H_kv, G, d], key/value [N, H_kv, Lk, d], ``bias`` [N, H_kv, G, Lk] (:func:`score_bias`)
    or None; returns [N, H_kv, G, d]."""

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
    """The softmax of the biased scores, float32 (float64 for float64 inputs, in tests), the bias
    and the scale taken inside the product."""
    rows, kv_heads, stacked, dim = q.shape
    work = torch.promote_types(q.dtype, torch.float32)
    q3 = q.to(work).reshape(-1, stacked, dim)
    k3 = key.to(work).reshape(-1, key.shape[-2], dim).transpose(1, 2)
    if bias is None:
        scores = torch.bmm(q3, k3).mul_(scale)
    else:
        scores = torch.baddbmm(bias.to(work).reshape(-1, stacked, k3.shape[-1]), q3, k3, alpha=scale)
    return torch.softmax(scores, -1).view(rows, kv_heads, stacked, -1)


def causal_starts(mask: torch.Tensor, queries: int) -> torch.Tensor | None:
    """Where each row's keys start, [N], when ``mask`` [N, 1, Lq, Lk] is causal attention over one
    unbroken run of keys per row (:func:`causal_layout`) and the causal kernel would do less work
    than the masked one (:func:`causal_kernel_pays`); ``None`` otherwise. Checked once per
    forward: the answer is kept on the mask, which every layer shares."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return None
    if not hasattr(mask, "_ngrpo_causal_starts"):
        starts = causal_layout(mask, queries)
        pays = starts is not None and causal_kernel_pays(starts, *mask.shape[-2:])
        mask._ngrpo_causal_starts = starts if pays else None
    return mask._ngrpo_causal_starts


def causal_layout(mask: torch.Tensor, queries: int) -> torch.Tensor | None:
    """Where each row's keys start, [N], when the boolean ``mask`` [N, 1, Lq, Lk] is exactly
    causal attention over one unbroken run of keys per row (left padding, then tokens, then
    right padding; the queries are the last Lq positions) and every row reads a key; ``None``
    otherwise."""
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
    """Whether the causal kernel on rows shifted to their ``starts`` (:func:`causal_attention`)
    computes clearly fewer query-key pairs than the masked kernel's ``queries x keys`` per row.
    The causal kernel gives each shifted position (zero queries included) the keys up to the end
    of its block of ``CAUSAL_KEY_BLOCK``: below one block it computes every pair, more than the
    masked kernel. Rows of different starts also pay for gathering the shifted rows, so they
    need a larger saving (the timings behind it: docs/performance.md, "Measurements behind the
    code")."""
    block = CAUSAL_KEY_BLOCK
    lengths = keys - starts.double()
    full = torch.div(lengths, block, rounding_mode="floor")
    causal = block * block * full * (full + 1) / 2 + (lengths - block * full) * lengths
    one_start = bool((starts == starts[0]).all())
    return float(causal.sum()) < (0.95 if one_start else 0.8) * len(starts) * queries * keys


def causal_attention(query, key, value, starts: torch.Tensor, scaling=None) -> torch.Tensor:
    """Causal attention with PyTorch's causal kernel, which skips the pairs above the diagonal
    that a masked kernel computes and throws away: query [N, H, Lq, d] at the last Lq of the key
    positions, key/value [N, H_kv, Lk, d], row r's keys starting at ``starts[r]``. Each row is
    shifted left by its start (its padding moves to the end, past every query that is read),
    and positions before the queries get zero queries whose outputs are dropped. Returns
    [N, H, Lq, d]; rows of padding queries (no key to read) are 0."""
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


def register() -> str:
    """Make ``sdpa_gqa`` known to transformers (its ``AttentionInterface``, with ``sdpa``'s mask
    builder): called by the backend that chooses it, before a model loads with it, never at
    import. Idempotent; returns the name."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, sdpa_gqa_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def known_attentions() -> list[str]:
    """The attention implementations a model can be loaded with here."""
    return sorted({"eager", NAME, *AttentionInterface._global_mapping})


def check_attn_implementation(name, key: str = "backend.attention") -> None:
    """``name`` is an attention transformers knows, ``sdpa_gqa``, or a hub kernel (``owner/repo``);
    otherwise a ``ValueError`` naming ``key`` and the allowed names."""
    known = known_attentions()
    if isinstance(name, str) and (name in known or "/" in name):
        return
    raise ValueError(f"{key}={name!r} is not an attention transformers knows: allowed auto, {', '.join(known)}")
