"""Rollouts on prepacked linear weights (oneDNN): same rollouts as the default matmul, the
model untouched outside the rollout, and nothing packed where it cannot be."""

import pytest
import torch
from conftest import chat_prompt_ids, trained_lora

from ngrpo_lightning.explorers import TemperatureExplorer
from ngrpo_lightning.rollout import HFEngine
from ngrpo_lightning.rollout.packed_weights import packed_linears, packing_available

pytestmark = pytest.mark.skipif(
    not packing_available(torch.float32), reason="this torch build cannot pack linear weights (no oneDNN)"
)

QUESTIONS = ["What is 7 + 5?", "What is 3 * 4?"]


def linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def packed_now(model):
    return sum("forward" in m.__dict__ for m in linears(model))


def test_packed_rollouts_match_the_default_matmul(smollm2):
    model, tok = smollm2
    prompts = chat_prompt_ids(tok, QUESTIONS)

    def rollout(packed, temperature, seed=0):
        engine = HFEngine(model, tok, max_new_tokens=16, seed=seed, packed_weights=packed)
        return engine.generate(prompts, TemperatureExplorer(temperature), n=4)

    greedy_packed, greedy = rollout(True, 0.0), rollout(False, 0.0)
    assert torch.equal(greedy_packed.response_ids, greedy.response_ids)
    assert torch.allclose(greedy_packed.rollout_logprobs, greedy.rollout_logprobs, atol=1e-4)
    sampled_packed, sampled = rollout(True, 1.0, seed=3), rollout(False, 1.0, seed=3)
    same = (sampled_packed.response_ids == sampled.response_ids).all(-1)
    assert same.float().mean() >= 0.75  # a row may flip where a draw falls on a rounding boundary
    assert torch.allclose(sampled_packed.rollout_logprobs[same], sampled.rollout_logprobs[same], atol=1e-4)


def test_layers_are_packed_only_inside_the_block(tiny):
    model, _ = tiny
    ids = torch.randint(0, model.config.vocab_size, (3, 7))
    with torch.no_grad():
        plain = model(ids).logits
        with packed_linears(model, rows=3) as count:
            assert count == len(linears(model)) == packed_now(model) > 0
            packed = model(ids).logits
        assert packed_now(model) == 0
    assert not torch.equal(packed, torch.zeros_like(packed))
    torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-4)

    with pytest.raises(KeyError), packed_linears(model, rows=3):  # an error inside still unpacks
        raise KeyError("stop")
    assert packed_now(model) == 0


def test_training_after_a_packed_rollout_reaches_every_weight(tiny):
    model, tok = tiny
    seen = []
    hook = linears(model)[0].register_forward_pre_hook(lambda m, args: seen.append("forward" in m.__dict__))
    try:
        HFEngine(model, tok, max_new_tokens=4).generate(chat_prompt_ids(tok, QUESTIONS), TemperatureExplorer(1.0), n=2)
        assert seen and all(seen)  # every rollout forward ran packed
        model.zero_grad(set_to_none=True)
        model(torch.randint(0, model.config.vocab_size, (2, 5))).logits.square().mean().backward()
    finally:
        hook.remove()
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in linears(model))
    model.zero_grad(set_to_none=True)


def test_nothing_is_packed_when_off_or_unsupported(tiny):
    model, tok = tiny
    seen = []
    hook = linears(model)[0].register_forward_pre_hook(lambda m, args: seen.append("forward" in m.__dict__))
    try:
        engine = HFEngine(model, tok, max_new_tokens=3, packed_weights=False)
        engine.generate(chat_prompt_ids(tok, QUESTIONS), TemperatureExplorer(1.0), n=2)
    finally:
        hook.remove()
    assert seen and not any(seen)

    class Scaled(torch.nn.Linear):  # a subclass may compute something else: left alone
        def forward(self, x):
            return 2 * super().forward(x)

    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), Scaled(4, 4), torch.nn.Linear(4, 4).double())
    with packed_linears(mixed, rows=2) as count:
        assert count == 1 and "forward" in mixed[0].__dict__
    with packed_linears(mixed, rows=2, enabled=False) as count:
        assert count == 0
    with pytest.raises(ValueError, match=r"rollout\.hf\.packed_weights='yes' must be true or false"):
        HFEngine(model, tok, packed_weights="yes")


def test_a_lora_layer_is_packed_merged_and_gives_the_adapted_output():
    peft = pytest.importorskip("peft")
    from ngrpo_lightning import lora

    policy = trained_lora(std=0.5, dropout=0.1)  # its own model (peft adapts in place); merged != base
    adapted = [m for m in policy.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    inner = {id(sub) for m in adapted for sub in m.modules() if type(sub) is torch.nn.Linear}
    others = [m for m in linears(policy) if id(m) not in inner]  # the LM head
    calls = []
    hooks = [m.register_forward_pre_hook(lambda m, args: calls.append(m)) for m in linears(policy)]
    ids = torch.randint(0, policy.config.vocab_size, (3, 7))
    policy.eval()
    try:
        with torch.no_grad():
            unmerged = policy(input_ids=ids).logits
            calls.clear()
            with packed_linears(policy, rows=3) as count:
                assert count == len(adapted) + len(others)
                assert all("forward" in m.__dict__ for m in adapted)
                merged = policy(input_ids=ids).logits
            assert not any(id(m) in inner for m in calls)  # no base or adapter product ran: one merged product
            with policy.disable_adapter(), packed_linears(policy, rows=3):  # adapters off: W alone
                base = policy(input_ids=ids).logits
            with policy.disable_adapter():
                expected_base = policy(input_ids=ids).logits
    finally:
        for hook in hooks:
            hook.remove()
    assert not any("forward" in m.__dict__ for m in linears(policy))  # unpacked after the block
    assert all(m.forward.__func__ is lora.lean_forward for m in adapted)  # the training forward is back
    assert not torch.allclose(unmerged, expected_base, atol=1e-3)
    torch.testing.assert_close(merged, unmerged, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(base, expected_base, atol=1e-4, rtol=1e-4)
    trained = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)  # nothing was merged into the base
