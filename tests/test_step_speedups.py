"""The step's CPU speed-ups change no value: a KV cache written in place during rollouts
(``ReservedLayer``), in float32 for a half-precision model on the CPU backend, and fused AdamW.
The attention ones (``sdpa_gqa``) are tested in test_attention.py."""

import pytest
import torch
from conftest import chat_prompt_ids
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ngrpo_lightning.config import ConfigError, compose
from ngrpo_lightning.explorers import NeighborMixingExplorer, TemperatureExplorer
from ngrpo_lightning.rollout import HFEngine, decoding
from ngrpo_lightning.rollout.kv_cache import ReservedLayer

QUESTIONS = [
    "What is 7 + 5?",
    "What is 3 * 4?",
    "Name the smallest prime number that is larger than twenty, then double it.",
]


# ------------------------------------------------------------------ ReservedLayer
def rollouts(model, tokenizer, explorer, cache_factory, monkeypatch, n=3, max_new_tokens=12, backend=None):
    monkeypatch.setattr(decoding, "reserved_cache", cache_factory)
    engine = HFEngine(model, tokenizer, max_new_tokens=max_new_tokens, seed=5, backend=backend)
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


# ------------------------------------------------------------------ host.* (removed)
@pytest.mark.parametrize("override", ["host.keep_freed_memory=yes", "host.allocator=mimalloc"])
def test_the_removed_host_settings_are_refused_as_unknown(override):
    """How the process uses its machine is no setting any more (the launcher's business, not the
    run's config): an old override fails at once, naming the key and the groups there are."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"unknown config key '{key}'; valid keys: \[.*'backend'"):
        compose(["model=tiny", override])
    assert "host" not in compose(["model=tiny"])


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

    from ngrpo_lightning.checkpoints.run import config_mismatch

    current = OmegaConf.to_container(compose(["model=tiny"]), resolve=True)
    older = OmegaConf.to_container(compose(["model=tiny"]), resolve=True)
    del older["backend"]  # a checkpoint's config from before the backend, with the keys it replaced
    older["host"] = {"allocator": "auto", "keep_freed_memory": True}
    older["model"].update(
        attn_implementation="sdpa_gqa", recompute_elementwise=True, recompute_up_proj=True, reference_weights="auto"
    )
    older["optim"].update(logprob_chunk_size=512, logprob_keep_softmax_mib=512, share_prompts=True, packed_weights=True)
    older["rollout"].update(ahead_threads=1, hf={"drop_min_frac": 0.0, "packed_weights": True})
    assert config_mismatch(older, current) is None
    changed = OmegaConf.to_container(compose(["model=tiny", "backend.attention=eager"]), resolve=True)
    assert config_mismatch(current, changed) is None  # the backend's choices give the same values
    older["model"]["dtype"] = "bfloat16"
    assert "model.dtype differs" in config_mismatch(older, current)


def test_a_bfloat16_rollout_keeps_its_cache_in_float32_with_the_same_tokens(monkeypatch):
    """A bfloat16 model decoding on CPU with sdpa_gqa keeps keys and values in float32: each is
    widened once when written, and the rollout equals one over transformers' bfloat16 cache."""
    from ngrpo_lightning.backends import CPUBackend
    from ngrpo_lightning.models.loading import load_policy
    from ngrpo_lightning.rollout.kv_cache import reserved_cache

    model, tok = load_policy("tiny", dtype="bfloat16")
    backend = CPUBackend(torch.bfloat16)  # its attention, sdpa_gqa, reads a float32 cache as it is
    assert backend.kv_cache_dtype(model) == torch.float32
    assert CPUBackend(torch.bfloat16, attention="sdpa").kv_cache_dtype(model) is None  # others read the model's dtype
    assert CPUBackend(torch.float32).kv_cache_dtype(load_policy("tiny")[0]) is None
    # stated by the backend, never read off the model: an engine without one keeps the model's dtype
    model.set_attn_implementation("sdpa_gqa")
    caches = []

    def ours(cap, store, reads=None):
        caches.append(reserved_cache(cap, store, reads))
        return caches[-1]

    explorer = TemperatureExplorer(1.0)
    narrow = rollouts(model, tok, explorer, ours, monkeypatch)
    assert caches[0].layers[0].key_buffer.dtype == torch.bfloat16
    wide = rollouts(model, tok, explorer, ours, monkeypatch, backend=backend)
    plain = rollouts(model, tok, explorer, lambda cap, store, reads=None: DynamicCache(), monkeypatch)
    assert caches[1].layers[0].key_buffer.dtype == torch.float32
    assert narrow.response_ids.shape == wide.response_ids.shape
    assert torch.equal(wide.response_ids, plain.response_ids)
    assert torch.equal(wide.rollout_logprobs, plain.rollout_logprobs)
    # one prompt: no padding, so no mask at all (transformers passes None)
    monkeypatch.setattr(decoding, "reserved_cache", ours)
    one = HFEngine(model, tok, max_new_tokens=6, seed=5, backend=backend)
    alone = one.generate(chat_prompt_ids(tok, QUESTIONS[:1]), explorer, n=1)
    monkeypatch.setattr(decoding, "reserved_cache", lambda cap, store, reads=None: DynamicCache())
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
