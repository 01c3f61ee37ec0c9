"""Attention passes at a bounded set of widths (backends/width_buckets.py): the widths, and the
padded pass giving transformers' values and gradients."""

import copy

import pytest
import torch
from test_attention import _attention_module
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ngrpo_lightning.backends.width_buckets import bucket_width, bucketed_attention


def test_bucket_widths_are_few_and_close():
    widths = [bucket_width(n) for n in range(1, 8193)]
    assert all(w >= n for n, w in enumerate(widths, 1))
    assert all(w - n <= max(63, n / 16) for n, w in enumerate(widths, 1))  # at most 63 positions or 6.25% more
    assert widths == sorted(widths) and all(bucket_width(w) == w for w in widths)
    assert len(set(widths[:1024])) == 16  # multiples of 64 up to 1,024
    assert len(set(widths[1024:2048])) == 16 and len(set(widths[4096:8192])) == 16  # then 16 per doubling
    assert [bucket_width(n) for n in (1, 64, 65, 300, 513, 1000, 5000)] == [64, 64, 128, 320, 576, 1024, 5120]


def _pass(lq, lk, rows=3, heads=6, kv_heads=2, dim=16, seed=0):
    """float64 queries, keys and values of a pass, with gradients."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, lq, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(rows, kv_heads, lk, dim, generator=g, dtype=torch.float64) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def _padded_rows_mask(lq, lk, prompt_pad=(0, 3, 5), response_end=(None, -4, -1)):
    """A log-prob pass's mask [3, 1, Lq, Lk]: causal over the last Lq of Lk positions, rows left
    padded in their prompts and right padded after their responses (their padding queries read no
    key, as transformers' own mask has them)."""
    keep = torch.ones(3, lk, dtype=torch.bool)
    for row, (pad, end) in enumerate(zip(prompt_pad, response_end)):
        keep[row, :pad] = False
        if end is not None:
            keep[row, end:] = False
    causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    return (causal & keep[:, None, :])[:, None] & keep[:, lk - lq :, None][:, None]


def _both_ways(q, k, v, mask, scaling=16**-0.5):
    """Outputs and gradients (q, k, v) of transformers' sdpa and of the bucketed pass."""
    results = []
    for attend in (sdpa_attention_forward, bucketed_attention):
        out, _ = attend(_attention_module(q, k), q, k, v, mask, scaling=scaling)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        results.append((out, *grads))
    return results


@pytest.mark.parametrize(
    "lq, lk, kind",
    [(70, 70, "bool"), (70, 70, "additive"), (70, 70, "causal, no mask"), (40, 110, "bool"), (129, 129, "bool")],
)
def test_a_bucketed_pass_gives_transformers_values_and_gradients(lq, lk, kind):
    """Padded to 128 (or 192) positions inside attention: the same output and the same gradients of
    queries, keys and values, the padding queries (reading no key) included."""
    q, k, v = _pass(lq, lk)
    mask = _padded_rows_mask(lq, lk)
    if kind == "additive":
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, torch.finfo(torch.float64).min)
    elif kind == "causal, no mask":
        mask = None
    plain, bucketed = _both_ways(q, k, v, mask)
    assert bucketed[0].shape == plain[0].shape == (3, lq, 6, 16)
    for got, want in zip(bucketed, plain):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_pass_at_a_bucket_width_or_with_a_cached_prefix_and_no_mask_is_not_padded():
    """At a bucket width only the mask's bias is made ahead (what PyTorch's attention makes of it
    at every call): bit for bit transformers' values; without a mask and not causal over its own
    positions, transformers' own call."""
    q, k, v = _pass(64, 64)
    mask = _padded_rows_mask(64, 64)
    plain, bucketed = _both_ways(q, k, v, mask)
    for got, want in zip(bucketed, plain):
        assert torch.equal(got, want)
    q, k, v = _pass(5, 9)  # no mask and fewer queries than keys: transformers' own handling
    plain, bucketed = _both_ways(q, k, v, None)
    for got, want in zip(bucketed, plain):
        assert torch.equal(got, want)
    q, k, v = _pass(70, 70)  # a padding mask broadcast over the queries, not causal: padded to 128
    keep = torch.ones(3, 1, 1, 70, dtype=torch.bool)
    keep[1, ..., :9] = False
    module = _attention_module(q, k)
    module.is_causal = False
    got, _ = bucketed_attention(module, q, k, v, keep)
    torch.testing.assert_close(got, sdpa_attention_forward(module, q, k, v, keep)[0], rtol=1e-12, atol=1e-12)
    q, k, v = _pass(70, 70)  # no mask, not causal (an encoder's attention): padded keys would be read
    module = _attention_module(q, k)
    module.is_causal = False
    got, _ = bucketed_attention(module, q, k, v, None)
    assert torch.equal(got, sdpa_attention_forward(module, q, k, v, None)[0])


def test_the_bias_hides_new_keys_lets_new_queries_read_and_is_made_once_per_forward():
    """``attention_bias``: the additive bias PyTorch's attention makes of a boolean mask (0 where a
    key is read, -inf where not), at the padded widths, kept for every layer by the attention's memo
    (nothing written on the mask) while the mask lives."""
    import gc

    from ngrpo_lightning.backends.memo import TensorMemo
    from ngrpo_lightning.backends.width_buckets import attention_bias

    mask, memo = _padded_rows_mask(5, 7), TensorMemo()
    bias = attention_bias(mask, 7, 64, 64, torch.bfloat16, memo)
    assert bias.shape == (3, 1, 64, 64) and bias.dtype == torch.bfloat16
    assert attention_bias(mask, 7, 64, 64, torch.bfloat16, memo) is bias  # once per forward: every layer reads it
    assert not vars(mask) and len(memo) == 1
    gone = _padded_rows_mask(5, 7)
    attention_bias(gone, 7, 64, 64, torch.bfloat16, memo)
    del gone
    gc.collect()
    assert len(memo) == 1  # a mask's bias goes with the mask
    assert torch.equal(bias[..., :5, :7] == 0, mask) and (bias[..., :5, :7][~mask] == float("-inf")).all()
    assert (bias[..., :5, 7:] == float("-inf")).all() and (bias[..., 5:, :] == 0).all()
    assert torch.equal(attention_bias(mask, 6, 5, 6, torch.float32) == 0, mask[..., :6])  # the mask wider
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    bias = attention_bias(additive, 7, 64, 64, torch.bfloat16)
    assert bias.dtype == torch.float32 and torch.equal(bias[..., :5, :7], additive)  # its own dtype and values
    assert (bias[..., :5, 7:] == float("-inf")).all() and (bias[..., 5:, :] == 0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_checks.sh runs this)")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_bucketed_passes_on_a_gpu_match_transformers(dtype, tol):  # pragma: no cover - no GPU in CI
    """On a GPU, where the attention kernel plans per shape: the backend's attention (sdpa_gqa) pads
    a masked pass and gives transformers' values and gradients."""
    from ngrpo_lightning.backends.attention import sdpa_gqa_attention_forward

    q, k, v = (t.detach().to("cuda", dtype).requires_grad_() for t in _pass(70, 70))
    mask = _padded_rows_mask(70, 70).cuda()
    results = []
    for attend in (sdpa_attention_forward, sdpa_gqa_attention_forward):
        out, _ = attend(_attention_module(q, k), q, k, v, mask, scaling=16**-0.5)
        results.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
    for got, want in zip(*results):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_a_model_with_bucketed_attention_gives_the_same_logits_and_gradients(tiny):
    """The tiny model, rows left padded to different lengths (transformers' own masks): its logits at
    real positions and its weights' gradients are those of transformers' sdpa."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    model, _ = tiny
    AttentionInterface.register("sdpa_bucketed", bucketed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa_bucketed", sdpa_mask)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (3, 70), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[2, :30] = 0
    before = model.config._attn_implementation
    results = []
    try:
        for name in ("sdpa", "sdpa_bucketed"):
            model.set_attn_implementation(name)
            model.zero_grad()
            logits = model(input_ids=ids, attention_mask=mask).logits
            (logits.log_softmax(-1)[..., 0] * mask).sum().backward()
            results.append((logits * mask[..., None], [p.grad.clone() for p in model.parameters()]))
    finally:
        model.set_attn_implementation(before)
        model.zero_grad()
    (logits_a, grads_a), (logits_b, grads_b) = results
    torch.testing.assert_close(logits_b, logits_a, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads_b, grads_a):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_decoding_step_on_a_growing_cache_reads_keys_at_a_bucket_width():
    """Eager decoding (FSDP2, cuda_eager) grows its cache one key per step: the stacked step pads the
    keys to their bucket width, masked out, and gives transformers' values; a static cache, whose
    kept length is a bucket width, is read in place."""
    from test_attention import _transformers_sdpa, static_cache_step

    from ngrpo_lightning.backends.attention import stacked_decoding_attention

    q, k, v, keep = static_cache_step()  # 12 keys, a mask of 14 columns
    got = stacked_decoding_attention(q, k, v, keep, 16**-0.5)
    torch.testing.assert_close(got, _transformers_sdpa(q, k, v, keep), rtol=1e-6, atol=1e-6)
    k, v = (torch.nn.functional.pad(t, (0, 0, 0, 52)) for t in (k, v))  # a static cache of 64 positions
    keep = torch.nn.functional.pad(keep, (0, 50))
    got = stacked_decoding_attention(q, k, v, keep, 16**-0.5)
    torch.testing.assert_close(got, _transformers_sdpa(q, k, v, keep), rtol=1e-6, atol=1e-6)
    assert all(bucket_width(n) == n for n in (64, 128, 576, 1152, 12288))  # kept static caches' lengths


def _gpu_dispatch(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """sdpa_gqa's dispatch on a GPU (decoding steps stacked, other passes bucketed), run on the CPU."""
    from ngrpo_lightning.backends.attention import stacked_decoding_attention

    if query.shape[-2] == 1 and attention_mask is not None:
        return stacked_decoding_attention(query, key, value, attention_mask, scaling), None
    return bucketed_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def test_a_growing_cache_read_at_bucket_widths_decodes_as_one_read_at_its_length(tiny):
    """Eager decoding on a GPU (FSDP2, cuda_eager) reads its reserved cache at the bucket width of its
    length, a view whose unwritten keys are masked (``Backend.kv_read_width``): with the GPU's
    attention dispatch, run here on the CPU, every step's logits are those of the cache read at
    its length, and the cache's length is still the filled part's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from ngrpo_lightning.backends.cuda import CUDABackend
    from ngrpo_lightning.rollout.kv_cache import reserved_cache

    model = copy.deepcopy(tiny[0]).eval()
    AttentionInterface.register("sdpa_gpu_dispatch", _gpu_dispatch)
    ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa_gpu_dispatch", sdpa_mask)
    model.set_attn_implementation("sdpa_gpu_dispatch")
    eager = CUDABackend(torch.float32, disable=["decode_graphs"], enable=["width_buckets"])
    assert eager.kv_read_width(model) is None  # on the CPU: read at its length
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    runs = []
    for read_width in (None, bucket_width):
        cache, mask, step_ids, logits = reserved_cache(9 + 12, None, read_width), torch.ones_like(ids), ids, []
        mask[1, :4] = 0  # left padded
        with torch.no_grad():
            for _ in range(12):
                positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
                out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
                logits.append(out.logits[:, -1])
                step_ids = out.logits[:, -1:].argmax(-1)
                mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
        runs.append(torch.stack(logits))
        layer = cache.layers[0]
        assert cache.get_seq_length() == 9 + 11 and layer.keys.shape[-2] == (64 if read_width else 20)
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-5)
