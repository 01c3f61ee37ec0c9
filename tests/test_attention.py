"""``sdpa_gqa`` (ngrpo_lightning/backends/attention.py) changes no value: grouped KV heads read in place,
decoding steps and short half-precision passes on matmuls, long causal passes on the causal
kernel; each against PyTorch's kernel, values and gradients."""

import pytest
import torch
from conftest import chat_prompt_ids
from transformers import AutoModelForCausalLM

from ngrpo_lightning.backends import attention
from ngrpo_lightning.backends.attention import check_attn_implementation
from ngrpo_lightning.config import ConfigError, compose
from ngrpo_lightning.models.loading import resolve_model_path

QUESTIONS = [
    "What is 9 - 4?",
    "Name a prime number between ten and twenty, then say why it is prime.",
]


# ------------------------------------------------------------------ sdpa_gqa
def load(attn: str) -> torch.nn.Module:
    if attn == attention.NAME:
        attention.register()  # as the CPU backend does before its models load
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny"), attn_implementation=attn)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads: the case at hand
    return model.train()


def left_padded(tokenizer):
    ids = chat_prompt_ids(tokenizer, QUESTIONS)
    width = max(map(len, ids))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(s)) + s for s in ids])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in ids])
    return input_ids, mask


def test_sdpa_gqa_matches_sdpa_values_and_gradients(tokenizer):
    input_ids, mask = left_padded(tokenizer)
    assert (mask == 0).any()  # a padding mask: the case where transformers repeats the KV heads on CPU
    grads, logits = [], []
    for attn in ("sdpa_gqa", "sdpa"):
        model = load(attn)
        assert model.config._attn_implementation == attn
        out = model(input_ids=input_ids, attention_mask=mask).logits
        (out[mask.bool()].log_softmax(-1)[:, :50].sum()).backward()
        logits.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        a, b = grads[0][name], grads[1][name]
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (name, (a - b).abs().max(), b.abs().max())


def test_policy_loads_with_sdpa_gqa_by_default(tiny):
    model, _ = tiny
    assert model.config._attn_implementation == "sdpa_gqa"


def test_remote_code_models_keep_transformers_attention():
    from ngrpo_lightning.models.loading import load_policy

    model, _ = load_policy("tiny", trust_remote_code=True)  # remote code may dispatch on the name
    assert model.config._attn_implementation == "sdpa"


def test_unknown_attention_is_refused_with_the_allowed_names():
    check_attn_implementation("eager")
    check_attn_implementation("kernels-community/flash-attn")  # a hub kernel: transformers resolves it
    check_attn_implementation(attention.NAME)  # known before it is registered: the CPU backend registers it
    with pytest.raises(ValueError, match=r"backend.attention='sdpx'.*eager.*sdpa_gqa"):
        check_attn_implementation("sdpx")
    with pytest.raises(ValueError, match=r"^model.attn_implementation='sdpx'"):  # a caller's own key
        check_attn_implementation("sdpx", key="model.attn_implementation")
    from ngrpo_lightning.build.components import check_config

    with pytest.raises(ConfigError, match=r"backend.attention='flash' is not an attention transformers knows"):
        check_config(compose(["model=tiny", "backend.attention=flash"]))
    check_config(compose(["model=tiny", "backend.attention=eager"]))
    # the key it replaced is refused, naming it
    with pytest.raises(ConfigError, match=r"unknown config key 'model.attn_implementation'"):
        compose(["model=tiny", "model.attn_implementation=sdpa"])


def _grouped_qkv(queries: int, keys: int, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 6, queries, 16, generator=g).to(dtype)
    k, v = (torch.randn(3, 2, keys, 16, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def test_grouped_attention_equals_sdpa_with_either_mask_kind():
    """A decoding step: two matmuls with a group's query heads stacked, against PyTorch's kernel."""
    from ngrpo_lightning.backends.attention import grouped_attention

    q, k, v = _grouped_qkv(1, 9)
    keep = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    keep[1, ..., :3] = False  # a left-padded row
    additive = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    for mask in (keep, additive):
        got = grouped_attention(q, k, v, mask)
        assert got.shape == (3, 1, 6, 16)
        torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=1e-6)
    unmasked = grouped_attention(q, k, v, keep.expand(3, 1, 1, 9).clone().fill_(True))
    assert not torch.allclose(unmasked[1], want.transpose(1, 2)[1], atol=1e-3)  # the padding mattered


def _attention_module(q, k):
    """What an attention function reads of its calling module."""
    from types import SimpleNamespace

    return SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], is_causal=True, training=False)


def _transformers_sdpa(q, k, v, mask):
    """transformers' sdpa given a mask: the KV heads copied per query head (``repeat_kv``), as on a GPU."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(_attention_module(q, k), q, k, v, mask[..., : k.shape[-2]], scaling=16**-0.5)[0]


def static_cache_step(device="cpu", dtype=torch.float32, heads=6, kv_heads=2):
    """A decoding step on a static cache: 3 rows, 12 positions kept of which each row reads its
    own (left padding, the positions not yet written), the mask wider than the keys as a bucket's."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, heads, 1, 16, generator=g).to(device, dtype)
    k, v = (torch.randn(3, kv_heads, 12, 16, generator=g).to(device, dtype) for _ in range(2))
    keep = torch.zeros(3, 1, 1, 14, dtype=torch.bool)
    keep[0, ..., :9] = True
    keep[1, ..., 4:9] = True  # left padded
    keep[2, ..., 2:12] = True
    return q, k, v, keep.to(device)


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_a_stacked_decoding_step_gives_transformers_sdpa(heads, kv_heads, dtype, tol):
    """On a GPU a decoding step stacks a group's query heads as queries of their KV head instead
    of copying the keys and values per query head: the same values (here on the CPU's kernel)."""
    q, k, v, keep = static_cache_step(dtype=dtype, heads=heads, kv_heads=kv_heads)
    got = attention.stacked_decoding_attention(q, k, v, keep, scaling=16**-0.5)
    assert got.shape == (3, 1, heads, 16)
    torch.testing.assert_close(got, _transformers_sdpa(q, k, v, keep), rtol=0, atol=tol)
    unmasked = attention.stacked_decoding_attention(q, k, v, torch.ones_like(keep), scaling=16**-0.5)
    assert not torch.allclose(unmasked, got, atol=1e-3)  # the mask mattered


def test_the_cuda_backend_decodes_with_sdpa_gqa():
    from transformers import AttentionInterface

    from ngrpo_lightning.backends import CUDABackend

    assert CUDABackend(torch.bfloat16).attention == attention.NAME
    assert attention.NAME in AttentionInterface._global_mapping  # registered before a model loads with it
    assert CUDABackend(torch.bfloat16, attention="sdpa").attention == "sdpa"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_checks.sh runs this)")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_decoding_step_on_a_gpu_reads_the_grouped_heads_in_place(dtype, tol):  # pragma: no cover - no GPU in CI
    """sdpa_gqa on a GPU: a decoding step through the stacked heads, transformers' values."""
    q, k, v, keep = static_cache_step("cuda", dtype)
    got, _ = attention.sdpa_gqa_attention_forward(_attention_module(q, k), q, k, v, keep, scaling=16**-0.5)
    torch.testing.assert_close(got, attention.stacked_decoding_attention(q, k, v, keep, 16**-0.5), rtol=0, atol=0)
    torch.testing.assert_close(got, _transformers_sdpa(q, k, v, keep), rtol=0, atol=tol)


def test_a_bfloat16_decoding_step_attends_in_float32():
    """sdpa_gqa: one query per row in bfloat16 (a decoding step) is computed in float32 (the CPU's
    bfloat16 kernel is slower there); short passes take the same matmuls (float32 scores)."""
    from types import SimpleNamespace

    from ngrpo_lightning.backends.attention import (
        grouped_attention,
        half_precision_products_pay,
        sdpa_gqa_attention_forward,
    )

    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    q1, k, v = _grouped_qkv(1, 9, torch.bfloat16)
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., :3] = False
    out, _ = sdpa_gqa_attention_forward(module, q1, k, v, mask)
    wide = grouped_attention(q1.float(), k.float(), v.float(), mask).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, wide)
    # the float32 cache of a bfloat16 rollout: the same values, nothing cast per step
    assert torch.equal(sdpa_gqa_attention_forward(module, q1, k.float(), v.float(), mask)[0], out)
    q4 = _grouped_qkv(4, 9, torch.bfloat16, seed=1)[0]
    m4 = mask.expand(3, 1, 4, 9).clone()
    m4[2, ..., 4] = False  # not a causal layout: the masked kernel
    out4, _ = sdpa_gqa_attention_forward(module, q4, k, v, m4)
    assert out4.dtype == torch.bfloat16 and torch.equal(out4, grouped_attention(q4, k, v, m4))
    # ... while short: long passes, and float32 ones, keep PyTorch's kernel
    long_q, long_k = torch.empty(1, 9, 256, 64, dtype=torch.bfloat16), torch.empty(1, 3, 340, 64, dtype=torch.bfloat16)
    assert half_precision_products_pay(long_q[:, :, :40], long_k[:, :, :106])
    assert not half_precision_products_pay(long_q, long_k)
    assert not half_precision_products_pay(long_q[:, :, :40].float(), long_k[:, :, :106].float())


def _padded_causal_mask(starts, ends, queries: int, keys: int) -> torch.Tensor:
    """transformers' sdpa mask: causal with the queries at the last positions, padding keys off."""
    position = torch.arange(keys)
    run = (position >= torch.tensor(starts)[:, None]) & (position < torch.tensor(ends)[:, None])
    causal = position[None] <= position[keys - queries :, None]
    return (causal[None] & run[:, None])[:, None]


@pytest.mark.parametrize(
    ("queries", "starts", "ends"),
    [
        (12, [0, 3, 5], [12, 10, 12]),  # a whole sequence: left-padded prompts, right-padded responses
        (12, [2, 2, 2], [12, 12, 10]),  # ... one prompt length: padding queries dropped, then put back as 0
        (8, [2, 2, 2], [12, 9, 12]),  # a response pass after a shared prompt, one start for every row
        (8, [0, 2, 3], [12, 12, 11]),  # ... and prompts of different lengths
    ],
)
def test_causal_attention_equals_the_masked_kernel_on_real_positions(queries, starts, ends):
    """The causal kernel (rows shifted to their first key) gives the masked kernel's values and
    gradients at every real query position; padding queries read no key and give 0."""
    from ngrpo_lightning.backends.attention import causal_attention, causal_layout

    mask = _padded_causal_mask(starts, ends, queries, 12)
    assert torch.equal(causal_layout(mask, queries), torch.tensor(starts))
    q, k, v = (t.double().requires_grad_() for t in _grouped_qkv(queries, 12))
    positions = torch.arange(12 - queries, 12)
    real = (positions[None] >= torch.tensor(starts)[:, None]) & (positions[None] < torch.tensor(ends)[:, None])
    grad = torch.randn(3, 6, queries, 16, dtype=torch.double) * real[:, None, :, None]  # the loss reads real ones
    outs, grads = [], []
    for fn in (
        lambda: causal_attention(q, k, v, torch.tensor(starts)),
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
    ):
        out = fn()
        outs.append(out * real[:, None, :, None])
        grads.append(torch.autograd.grad(out, (q, k, v), grad))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    padding = (positions[None] < torch.tensor(starts)[:, None])[:, None, :, None]  # before a row's first key
    assert (causal_attention(q, k, v, torch.tensor(starts)) * padding == 0).all()


def _flash_style(q, k, v, mask):
    """HalfPrecisionAttention on [N, H, Lq, d] queries, as grouped_attention calls it, [N, H, Lq, d]."""
    from ngrpo_lightning.backends.attention import HalfPrecisionAttention, score_bias

    rows, heads, lq, dim = q.shape
    stacked = q.reshape(rows, k.shape[1], -1, dim)
    out = HalfPrecisionAttention.apply(stacked, k, v, score_bias(mask, stacked.shape, q.dtype), dim**-0.5)
    return out.view(rows, heads, lq, dim)


@pytest.mark.parametrize("path", ["matmuls", "flash-style", "bfloat16"])
def test_grouped_attention_gives_the_kernels_values_and_gradients_on_real_positions(path):
    """Attention as matmuls (padded prompts, a response pass after a shared prompt): in float64
    the masked kernel's values and gradients, both the plain matmuls and the half-precision
    function that recomputes the probabilities in backward; in bfloat16 (that function) no
    further from float64 than the bfloat16 kernel is. A padding query reads no key: 0, no NaN."""
    from ngrpo_lightning.backends.attention import grouped_attention

    starts, ends, queries = [0, 3, 5], [12, 10, 12], 8
    mask = _padded_causal_mask(starts, ends, queries, 12)
    positions = torch.arange(12 - queries, 12)
    real = (positions[None] >= torch.tensor(starts)[:, None]) & (positions[None] < torch.tensor(ends)[:, None])
    grad = torch.randn(3, 6, queries, 16, dtype=torch.double, generator=torch.Generator().manual_seed(0))
    grad = grad * real[:, None, :, None]

    def run(fn, dt):
        q, k, v = (t.to(dt).requires_grad_() for t in _grouped_qkv(queries, 12, torch.double))
        out = fn(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad.to(dt))
        return (out.double() * real[:, None, :, None], *(g.double() for g in grads))

    kernel = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ours = lambda q, k, v: grouped_attention(q, k, v, mask).transpose(1, 2)
    exact = run(kernel, torch.double)
    if path == "bfloat16":
        got, narrow = run(ours, torch.bfloat16), run(kernel, torch.bfloat16)
        for a, b, want in zip(got, narrow, exact, strict=True):
            # two roundings of the same bfloat16 values differ by up to a step (2^-7 of the largest):
            # the largest errors, one ulp each, were 1.9x apart for some gradients (200 tried)
            assert (a - want).abs().max() <= 1.5 * (b - want).abs().max() + 2**-7 * want.abs().max()
    else:
        got = run(ours if path == "matmuls" else lambda q, k, v: _flash_style(q, k, v, mask), torch.double)
        for a, b in zip(got, exact, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert all(torch.isfinite(t).all() for t in got)
    before = (positions[None] < torch.tensor(starts)[:, None])[:, None, :, None]  # before a row's first key
    dtype = torch.bfloat16 if path == "bfloat16" else torch.double
    assert before.any() and (ours(*_grouped_qkv(queries, 12, dtype)) * before == 0).all()


def test_causal_layout_is_taken_only_where_it_holds_and_pays():
    from ngrpo_lightning.backends.attention import causal_layout, causal_starts
    from ngrpo_lightning.backends.memo import TensorMemo

    holed = _padded_causal_mask([0, 0], [10, 10], 10, 10)
    holed[0, :, :, 4] = False  # a padding token inside a row: not one unbroken run
    assert causal_layout(holed, 10) is None
    empty = _padded_causal_mask([0, 10], [10, 10], 10, 10)
    assert causal_layout(empty, 10) is None  # a row with no key at all
    # the causal kernel skips keys in blocks of 512: long rows pay, short ones do not
    long_rows = _padded_causal_mask([0, 30, 60, 90], [1104] * 4, 1024, 1104)
    assert torch.equal(causal_starts(long_rows, 1024), torch.tensor([0, 30, 60, 90]))
    memo = TensorMemo()  # what the registered attention function keeps, once per mask
    assert causal_starts(long_rows, 1024, memo) is causal_starts(long_rows, 1024, memo)  # decided once per mask
    assert causal_starts(long_rows, 1024) is not causal_starts(long_rows, 1024)  # without a memo: at each call
    assert not vars(long_rows)  # nothing written on the mask
    one_start = _padded_causal_mask([0] * 4, [700] * 4, 620, 700)  # one start: a smaller saving pays
    assert causal_starts(one_start, 620) is not None
    shorter = _padded_causal_mask([0, 30, 60, 84], [340] * 4, 256, 340)  # 256 responses after their prompts
    assert causal_layout(shorter, 256) is not None and causal_starts(shorter, 256) is None
    long_prefix = _padded_causal_mask([0, 0], [1100, 1100], 4, 1100)  # 4 queries after 1,096 cached positions
    assert causal_starts(long_prefix, 4) is None  # the zero queries would cost more than the mask saves
