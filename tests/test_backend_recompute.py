"""Cheap activations recomputed in backward (``backends/recompute.py``): same losses and
gradients, fewer kept bytes; the modules are swapped by class, the recipes are kept by the
forward's recording (not on the tensors) and only a recording forward (its context, not another
thread's) tags anything."""

from __future__ import annotations

import contextlib
import copy
import gc
import threading

import pytest
import torch

from ngrpo_lightning.backends import recompute
from ngrpo_lightning.models.loading import load_policy


def kept_bytes(model, ids) -> tuple[torch.Tensor, int]:
    """Loss of a forward and the bytes autograd keeps for its backward (unique storages),
    after the recomputing hooks had their say (the tally sees what they pass on)."""
    kept = {}
    with recompute.tallying_kept(kept):
        loss = model(input_ids=ids).logits.float().log_softmax(-1).mean()
    loss.backward()
    return loss.detach(), sum(kept.values())


def grads_of(model, ids, context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with context:
        loss = model(input_ids=ids).logits.float().log_softmax(-1).mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def live_recipes() -> int:
    gc.collect()
    return sum(type(o) is recompute._Recipe for o in gc.get_objects())


@contextlib.contextmanager
def up_projection_kept():
    """The MLPs recompute their elementwise outputs only: the up projection is kept, as a layer
    that cannot be run again exactly would be."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recompute, "recomputable", lambda layer: False)
        yield


@pytest.mark.parametrize("up_proj", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_losses_and_gradients_are_bit_identical(dtype, up_proj):
    plain, _ = load_policy("tiny", dtype=dtype)
    patched = copy.deepcopy(plain)
    layers = plain.config.num_hidden_layers
    before = live_recipes()
    assert recompute.recomputing_modules(patched) == 3 * layers + 1  # 2 norms + an MLP per layer, final norm
    assert isinstance(patched.model.norm, recompute.RecomputingRMSNorm)
    assert isinstance(patched.model.layers[0].mlp, recompute.RecomputingGatedMLP)
    assert not any("forward" in vars(m) for m in patched.modules())  # swapped by class
    ids = torch.randint(0, plain.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    loss0, grads0 = grads_of(plain, ids, contextlib.nullcontext())
    with contextlib.nullcontext() if up_proj else up_projection_kept():
        loss1, grads1 = grads_of(patched, ids, recompute.recomputing())
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name
    assert not recompute._recording.get()  # the context is closed
    assert live_recipes() == before  # nothing outlives the forward's graph


def test_fewer_bytes_are_kept_for_backward():
    plain, _ = load_policy("tiny")
    patched = copy.deepcopy(plain)
    recompute.recomputing_modules(patched)
    ids = torch.randint(0, plain.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    loss0, before = kept_bytes(plain, ids)
    with up_projection_kept():
        loss1, after = kept_bytes(patched, ids)
    assert torch.equal(loss0, loss1)
    c, tokens = plain.config, ids.numel()
    # per layer: both norms' normalized input and output, act(gate) and act(gate) * up; the final
    # norm's two (its output feeds the LM head)
    expected = tokens * 4 * ((4 * c.hidden_size + 2 * c.intermediate_size) * c.num_hidden_layers + 2 * c.hidden_size)
    assert before - after == expected
    loss2, fewer = kept_bytes(patched, ids)  # the default: the up projection is recomputed too
    assert torch.equal(loss0, loss2)
    assert after - fewer == tokens * 4 * c.intermediate_size * c.num_hidden_layers  # each layer's up(x) too


def test_up_projection_is_recomputed_once_per_layer():
    """The product's recompute and the product's own backward share one recomputed up(x)."""
    model, _ = load_policy("tiny")
    recompute.recomputing_modules(model)
    calls = []
    original = recompute._layer_of

    def counting(*args):
        calls.append(1)
        return original(*args)

    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recompute, "_layer_of", counting)
        with recompute.recomputing():
            loss = model(input_ids=ids).logits.float().log_softmax(-1).mean()
        loss.backward()
    assert len(calls) == model.config.num_hidden_layers


def test_a_module_that_computes_something_else_keeps_its_class():
    class OffsetRMSNorm(torch.nn.Module):  # Gemma's kind: weight applied as (1 + weight)
        def __init__(self, width):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.zeros(width)), 1e-6

        def forward(self, x):
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (1 + self.weight) * x

    model = torch.nn.Sequential(OffsetRMSNorm(8), torch.nn.Linear(8, 8))
    assert recompute.recomputing_modules(model) == 0
    assert type(model[0]) is OffsetRMSNorm and "forward" not in vars(model[0])


def test_outside_the_context_nothing_is_tagged():
    model, _ = load_policy("tiny")
    recompute.recomputing_modules(model)
    outputs = []
    hook = model.model.norm.register_forward_hook(lambda m, args, out: outputs.append(out))
    try:
        out = model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum()
    finally:
        hook.remove()
    assert outputs and recompute.recipe_of(outputs[0]) is None
    out.backward()  # and backward works as usual
    assert model.model.norm.weight.grad is not None


def test_a_forward_on_another_thread_is_not_recorded():
    """The recording flag is the training forward's context: a rollout decoding on a worker
    thread at the same time (max_staleness) tags nothing."""
    model, _ = load_policy("tiny")
    recompute.recomputing_modules(model)
    outputs = {}
    hook = model.model.norm.register_forward_hook(
        lambda m, args, out: outputs.__setitem__(threading.current_thread().name, out)
    )
    ids = torch.tensor([[1, 2, 3]])
    try:
        with recompute.recomputing() as recording:
            worker = threading.Thread(target=lambda: model(input_ids=ids), name="worker")
            worker.start()
            worker.join()
            model(input_ids=ids)
    finally:
        hook.remove()
    assert recording.recipe_of(outputs["worker"]) is None
    assert recording.recipe_of(outputs[threading.current_thread().name]) is not None
    assert not any(vars(out) for out in outputs.values())  # the recording holds the recipes, not the tensors


def adapted_tiny(seed: int = 3):
    """The tiny model with rank-4 adapters on every linear layer, B nonzero (A's gradient too)."""
    from ngrpo_lightning.models import lora

    model, _ = load_policy("tiny")
    model = lora.apply(model, lora.LoraSettings(enabled=True, rank=4, alpha=8))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def test_a_lora_up_projection_is_recomputed_with_the_same_gradients():
    plain = adapted_tiny()
    patched = copy.deepcopy(plain)
    recompute.recomputing_modules(patched)
    ids = torch.randint(0, plain.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(4))
    loss0, grads0 = grads_of(plain, ids, contextlib.nullcontext())
    loss1, grads1 = grads_of(patched, ids, recompute.recomputing())
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and any("lora_A" in name for name in grads0)
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name
    with up_projection_kept():
        _, without_up = kept_bytes(patched, ids)
    _, fewer = kept_bytes(patched, ids)
    c = plain.config
    assert without_up - fewer == ids.numel() * 4 * c.intermediate_size * c.num_hidden_layers


def test_a_lora_up_projection_with_dropout_is_kept():
    """A recompute would draw another dropout mask: the adapted up(x) stays kept."""
    from ngrpo_lightning.models import lora

    model, _ = load_policy("tiny")
    model = lora.apply(model, lora.LoraSettings(enabled=True, rank=4, alpha=8, dropout=0.1))
    mlp = model.base_model.model.model.layers[0].mlp
    assert not recompute.recomputable(mlp.up_proj)
    assert recompute.recomputable(adapted_tiny().base_model.model.model.layers[0].mlp.up_proj)
