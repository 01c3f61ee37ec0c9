"""The step's CPU speed-ups change no value: grouped KV heads read in place (``sdpa_gqa``), a
KV cache written in place during rollouts (``ReservedLayer``), and freed memory kept in the
process (``host.keep_freed_memory``)."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import chat_prompt_ids
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from ngrpo_lightning.attention import check_attn_implementation
from ngrpo_lightning.config import ConfigError, compose
from ngrpo_lightning.explorers import NeighborMixingExplorer, TemperatureExplorer
from ngrpo_lightning.models import resolve_model_path
from ngrpo_lightning.rollout import HFEngine, hf_engine
from ngrpo_lightning.rollout.kv_cache import ReservedLayer

QUESTIONS = [
    "What is 7 + 5?",
    "What is 3 * 4?",
    "Name the smallest prime number that is larger than twenty, then double it.",
]


# ------------------------------------------------------------------ sdpa_gqa
def load(attn: str) -> torch.nn.Module:
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
    from ngrpo_lightning.models import load_policy

    model, _ = load_policy("tiny", trust_remote_code=True)  # remote code may dispatch on the name
    assert model.config._attn_implementation == "sdpa"


def test_unknown_attention_is_refused_with_the_allowed_names():
    check_attn_implementation("eager")
    check_attn_implementation("kernels-community/flash-attn")  # a hub kernel: transformers resolves it
    with pytest.raises(ValueError, match=r"model.attn_implementation='sdpx'.*eager.*sdpa_gqa"):
        check_attn_implementation("sdpx")
    from ngrpo_lightning.build import check_config

    with pytest.raises(ConfigError, match="model.attn_implementation"):
        check_config(compose(["model=tiny", "model.attn_implementation=flash"]))


# ------------------------------------------------------------------ ReservedLayer
def rollouts(model, tokenizer, explorer, cache_factory, monkeypatch, n=3, max_new_tokens=12):
    monkeypatch.setattr(hf_engine, "reserved_cache", cache_factory)
    engine = HFEngine(model, tokenizer, max_new_tokens=max_new_tokens, seed=5)
    return engine.generate(chat_prompt_ids(tokenizer, QUESTIONS), explorer, n=n)


@pytest.mark.parametrize("capacity", [None, 4])  # None: the rollout's length; 4: outgrown, the buffers grow
def test_reserved_cache_rollouts_equal_dynamic_cache(tiny, monkeypatch, capacity):
    from ngrpo_lightning.rollout.kv_cache import reserved_cache

    model, tok = tiny
    for explorer in (TemperatureExplorer(1.0), NeighborMixingExplorer(k=4, rho=0.5)):
        ours = rollouts(model, tok, explorer, lambda cap, *store: reserved_cache(capacity or cap, *store), monkeypatch)
        theirs = rollouts(model, tok, explorer, lambda cap, *store: DynamicCache(), monkeypatch)
        lengths = ours.response_mask.sum(1)
        assert torch.equal(ours.response_ids, theirs.response_ids)
        assert torch.equal(ours.rollout_logprobs, theirs.rollout_logprobs)
        assert torch.equal(lengths, theirs.response_mask.sum(1))


def test_reserved_layer_follows_dynamic_layer_through_row_and_length_edits():
    torch.manual_seed(0)
    ours, reference = ReservedLayer(capacity=6), DynamicLayer()
    edits = [
        ("update", 5),  # the prefill
        ("update", 1),
        ("batch_select_indices", torch.tensor([0, 2, 3])),
        ("update", 1),  # outgrows the 6 reserved positions
        ("reorder_cache", torch.tensor([2, 2, 0])),
        ("batch_repeat_interleave", 2),
        ("crop", -2),
        ("update", 3),
        ("crop", 5),  # transformers' deprecated form: the length to keep
        ("crop", 9),  # longer than the cache: nothing to drop
        ("update", 1),
    ]
    rows = 4
    for name, arg in edits:
        if name == "update":
            keys, values = torch.randn(rows, 2, arg, 8), torch.randn(rows, 2, arg, 8)
            got, want = ours.update(keys, values), reference.update(keys, values)
        else:
            getattr(ours, name)(arg)
            getattr(reference, name)(arg)
            got, want = (ours.keys, ours.values), (reference.keys, reference.values)
        rows = want[0].shape[0]
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
        assert ours.get_seq_length() == reference.get_seq_length(), name
    assert ours.key_buffer.shape[-2] > 6  # it did grow


# ------------------------------------------------------------------ host.keep_freed_memory
RSS_AFTER_FREE = """
import json, sys, psutil, torch
if sys.argv[1] == "keep":
    from ngrpo_lightning.host_memory import keep_freed_memory
    assert keep_freed_memory()
before = psutil.Process().memory_info().rss
x = torch.ones(64 * 2**20)  # 256 MiB, touched
del x
print(json.dumps((psutil.Process().memory_info().rss - before) / 2**20))
"""


def rss_kept_after_free(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", RSS_AFTER_FREE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_keep_freed_memory_keeps_a_freed_block_for_reuse():
    assert rss_kept_after_free("default") < 64  # glibc gives a freed 256 MiB block back at once
    assert rss_kept_after_free("keep") > 200  # kept: the next step's tensors reuse its pages


def test_keep_freed_memory_setting_is_checked():
    from ngrpo_lightning.build import check_config

    assert compose(["model=tiny"]).host.keep_freed_memory is True
    with pytest.raises(ConfigError, match="host.keep_freed_memory='yes' must be true or false"):
        check_config(compose(["model=tiny", "host.keep_freed_memory=yes"]))


# ------------------------------------------------------------------ fused AdamW
def test_optimizer_is_fused_adamw_with_the_unfused_update(tiny):
    from conftest import ScriptedReward, tiny_rl

    module, _ = tiny_rl(tiny, ScriptedReward([1, 0]))
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True
    params = list(module.policy.parameters())
    before = [p.detach().clone() for p in params]
    torch.manual_seed(0)
    grads = [torch.randn_like(p) for p in params]
    results = []
    for fused in (True, None):
        with torch.no_grad():
            for p, b in zip(params, before):
                p.copy_(b)
        opt = torch.optim.AdamW(params, lr=1e-2, fused=fused)
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_checkpoints_from_before_these_settings_still_resume():
    from omegaconf import OmegaConf

    from ngrpo_lightning.checkpointing import config_mismatch

    current = OmegaConf.to_container(compose(["model=tiny"]), resolve=True)
    older = OmegaConf.to_container(compose(["model=tiny"]), resolve=True)
    del older["host"], older["model"]["attn_implementation"]  # a checkpoint's config from before they existed
    del older["optim"]["logprob_keep_softmax_mib"], older["optim"]["packed_weights"]
    assert config_mismatch(older, current) is None
    older["model"]["dtype"] = "bfloat16"
    assert "model.dtype differs" in config_mismatch(older, current)


def _grouped_qkv(queries: int, keys: int, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 6, queries, 16, generator=g).to(dtype)
    k, v = (torch.randn(3, 2, keys, 16, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def test_grouped_attention_equals_sdpa_with_either_mask_kind():
    """A decoding step: two matmuls with a group's query heads stacked, against PyTorch's kernel."""
    from ngrpo_lightning.attention import grouped_attention

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


def test_a_bfloat16_decoding_step_attends_in_float32():
    """sdpa_gqa: one query per row in bfloat16 (a decoding step) is computed in float32 (the CPU's
    bfloat16 kernel is slower there); short passes take the same matmuls (float32 scores)."""
    from types import SimpleNamespace

    from ngrpo_lightning.attention import grouped_attention, half_precision_products_pay, sdpa_gqa_attention_forward

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
    from ngrpo_lightning.attention import causal_attention, causal_layout

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
    from ngrpo_lightning.attention import HalfPrecisionAttention, score_bias

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
    from ngrpo_lightning.attention import grouped_attention

    starts, ends, queries = [0, 3, 5], [12, 10, 12], 8
    mask = _padded_causal_mask(starts, ends, queries, 12)
    positions = torch.arange(12 - queries, 12)
    real = (positions[None] >= torch.tensor(starts)[:, None]) & (positions[None] < torch.tensor(ends)[:, None])
    grad = torch.randn(3, 6, queries, 16, dtype=torch.double) * real[:, None, :, None]

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
            assert (a - want).abs().max() <= 1.5 * (b - want).abs().max()
    else:
        got = run(ours if path == "matmuls" else lambda q, k, v: _flash_style(q, k, v, mask), torch.double)
        for a, b in zip(got, exact, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert all(torch.isfinite(t).all() for t in got)
    before = (positions[None] < torch.tensor(starts)[:, None])[:, None, :, None]  # before a row's first key
    dtype = torch.bfloat16 if path == "bfloat16" else torch.double
    assert before.any() and (ours(*_grouped_qkv(queries, 12, dtype)) * before == 0).all()


def test_causal_layout_is_taken_only_where_it_holds_and_pays():
    from ngrpo_lightning.attention import causal_layout, causal_starts

    holed = _padded_causal_mask([0, 0], [10, 10], 10, 10)
    holed[0, :, :, 4] = False  # a padding token inside a row: not one unbroken run
    assert causal_layout(holed, 10) is None
    empty = _padded_causal_mask([0, 10], [10, 10], 10, 10)
    assert causal_layout(empty, 10) is None  # a row with no key at all
    # the causal kernel skips keys in blocks of 512: long rows pay, short ones do not
    long_rows = _padded_causal_mask([0, 30, 60, 90], [1104] * 4, 1024, 1104)
    assert torch.equal(causal_starts(long_rows, 1024), torch.tensor([0, 30, 60, 90]))
    assert causal_starts(long_rows, 1024) is causal_starts(long_rows, 1024)  # decided once per mask
    one_start = _padded_causal_mask([0] * 4, [700] * 4, 620, 700)  # one start: a smaller saving pays
    assert causal_starts(one_start, 620) is not None
    shorter = _padded_causal_mask([0, 30, 60, 84], [340] * 4, 256, 340)  # 256 responses after their prompts
    assert causal_layout(shorter, 256) is not None and causal_starts(shorter, 256) is None
    long_prefix = _padded_causal_mask([0, 0], [1100, 1100], 4, 1100)  # 4 queries after 1,096 cached positions
    assert causal_starts(long_prefix, 4) is None  # the zero queries would cost more than the mask saves


def test_a_bfloat16_rollout_keeps_its_cache_in_float32_with_the_same_tokens(monkeypatch):
    """A bfloat16 model decoding on CPU with sdpa_gqa keeps keys and values in float32: each is
    widened once when written, and the rollout equals one over transformers' bfloat16 cache."""
    from ngrpo_lightning.models import load_policy
    from ngrpo_lightning.rollout.kv_cache import reserved_cache, store_dtype_for

    model, tok = load_policy("tiny", dtype="bfloat16")
    assert store_dtype_for(model) == torch.float32
    model.set_attn_implementation("sdpa")
    assert store_dtype_for(model) is None  # other attentions read the model's dtype
    model.set_attn_implementation("sdpa_gqa")
    caches = []

    def ours(cap, store):
        caches.append(reserved_cache(cap, store))
        return caches[-1]

    explorer = TemperatureExplorer(1.0)
    wide = rollouts(model, tok, explorer, ours, monkeypatch)
    plain = rollouts(model, tok, explorer, lambda cap, store: DynamicCache(), monkeypatch)
    assert caches[0].layers[0].key_buffer.dtype == torch.float32
    assert torch.equal(wide.response_ids, plain.response_ids)
    assert torch.equal(wide.rollout_logprobs, plain.rollout_logprobs)
    # one prompt: no padding, so no mask at all (transformers passes None)
    monkeypatch.setattr(hf_engine, "reserved_cache", ours)
    alone = HFEngine(model, tok, max_new_tokens=6, seed=5).generate(chat_prompt_ids(tok, QUESTIONS[:1]), explorer, n=1)
    monkeypatch.setattr(hf_engine, "reserved_cache", lambda cap, store: DynamicCache())
    alone_plain = HFEngine(model, tok, max_new_tokens=6, seed=5).generate(chat_prompt_ids(tok, QUESTIONS[:1]), explorer)
    assert caches[-1].layers[0].key_buffer.dtype == torch.float32
    assert torch.equal(alone.response_ids, alone_plain.response_ids)


def test_a_wide_reserved_layer_holds_the_widened_values():
    ours, reference = ReservedLayer(capacity=8, store_dtype=torch.float32), DynamicLayer()
    for length in (5, 1, 1):
        keys, values = (torch.randn(2, 2, length, 8).to(torch.bfloat16) for _ in range(2))
        got, want = ours.update(keys, values), reference.update(keys, values)
        if length == 5:  # the prefill reads what the model made
            assert got[0] is keys and got[1] is values
        else:
            assert got[0].dtype == torch.float32
            assert torch.equal(got[0], want[0].float()) and torch.equal(got[1], want[1].float())
