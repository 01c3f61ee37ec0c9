"""The step's CPU speed-ups change no value: a KV cache written in place during rollouts
(``ReservedLayer``), freed memory kept in the process (``host.keep_freed_memory``) and fused
AdamW. The attention ones (``sdpa_gqa``) are tested in test_attention.py."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import chat_prompt_ids
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ngrpo_lightning.config import ConfigError, compose
from ngrpo_lightning.explorers import NeighborMixingExplorer, TemperatureExplorer
from ngrpo_lightning.rollout import HFEngine, hf_engine
from ngrpo_lightning.rollout.kv_cache import ReservedLayer

QUESTIONS = [
    "What is 7 + 5?",
    "What is 3 * 4?",
    "Name the smallest prime number that is larger than twenty, then double it.",
]


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
