"""The linear layer a backend swaps in (``backends/packing.py``, ``backends/passes.py``): products on
oneDNN-packed weights, per product in the policy's passes and its update, once per pass in a
rollout or the frozen reference's pass. Values and gradients equal to plain products' to float
rounding; which layers take them; the rest unchanged. ``packing="on"`` / ``"off"`` force both
choices, so nothing here depends on what this machine measures."""

import copy

import pytest
import torch
from conftest import chat_prompt_ids, trained_lora

from ngrpo_lightning.backends import CPUBackend
from ngrpo_lightning.backends import packing as packing_module
from ngrpo_lightning.backends.lora import LeanLoraLinear
from ngrpo_lightning.backends.packing import BackendLinear, PackedLinearFunction, packing_available
from ngrpo_lightning.backends.passes import packed_for_pass
from ngrpo_lightning.compat.torch import linear_pointwise
from ngrpo_lightning.explorers import TemperatureExplorer
from ngrpo_lightning.models import lora
from ngrpo_lightning.models.loading import load_policy
from ngrpo_lightning.rollout import HFEngine

pytestmark = pytest.mark.skipif(not packing_available(torch.float32), reason="this CPU build has no oneDNN packing")

QUESTIONS = ["What is 7 + 5?", "What is 3 * 4?"]


def prepared(model, packing: str, trains: bool = False):
    """``model`` with its modules swapped by a CPU backend whose packing is forced ``on`` or ``off``."""
    return CPUBackend(next(model.parameters()).dtype, packing=packing).prepare(model, trains=trains)


def linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def backend_linears(model):
    return [m for m in model.modules() if isinstance(m, BackendLinear)]


def packed_now(model):
    return sum(m._pass_weight is not None for m in backend_linears(model))


def no_instance_forward(model):
    return not any("forward" in vars(m) for m in model.modules())


@pytest.fixture
def counted_products(monkeypatch):
    """How many products ran through :class:`PackedLinearFunction` (a packed product per call)."""
    calls = []
    original = packing_module.PackedLinearFunction

    class Counting(original):
        @staticmethod
        def apply(*args):
            calls.append(1)
            return original.apply(*args)

    monkeypatch.setattr(packing_module, "PackedLinearFunction", Counting)
    return calls


# ------------------------------------------------------------------ products per product (training)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_products_and_their_gradients_equal_plain_ones(dtype, tol, bias):
    if not packing_available(dtype):
        pytest.skip(f"no packed {dtype} products on this CPU")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 96, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(80, 96, generator=g) / 10).to(dtype).requires_grad_()
    b = torch.randn(80, generator=g).to(dtype).requires_grad_() if bias else None
    up = torch.randn(3, 37, 80, generator=g).to(dtype)
    grads = []
    for fn in (torch.nn.functional.linear, PackedLinearFunction.apply):
        y = fn(x, w, b)
        inputs = [x, w] + ([b] if bias else [])
        grads.append((y.detach(), *torch.autograd.grad((y * up).sum(), inputs)))
    for plain, packed in zip(*grads):
        scale = plain.abs().max().float()
        assert (plain.float() - packed.float()).abs().max() <= tol * scale


def test_a_product_on_a_weight_that_is_neither_layout_is_still_right():
    """oneDNN reads a weight or its transpose as it lies; any other strides (a slice of a wider matrix,
    transposed) go contiguous first, since oneDNN's path for them is hundreds of times slower."""
    if not packing_available(torch.float32):
        pytest.skip("no oneDNN products on this CPU")
    g = torch.Generator().manual_seed(0)
    x, wide = torch.randn(6, 16, generator=g), torch.randn(16, 40, generator=g)
    for weight in (wide[:, :24].t(), wide.t(), wide[:, :24].t().contiguous()):
        torch.testing.assert_close(linear_pointwise(x, weight, None), x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_a_frozen_weight_keeps_no_input_and_gets_no_gradient():
    x = torch.randn(5, 64, requires_grad=True)
    w = torch.randn(64, 64)  # LoRA's base layer: frozen
    y = PackedLinearFunction.apply(x, w, None)
    (gx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, torch.ones(5, 64) @ w, rtol=1e-5, atol=1e-5)


def test_the_decoder_linears_take_them_and_the_lm_head_only_for_decoding(counted_products):
    model, _ = load_policy("tiny")
    layers = model.config.num_hidden_layers
    prepared(model, "on", trains=True)
    swapped = [m for m in backend_linears(model) if not m.decode_only]
    assert len(swapped) == 7 * layers  # q, k, v, o, gate, up, down
    assert all(m.pack_per_product and m.pack_once and m.why for m in swapped)
    assert type(model.model.layers[0].self_attn.q_proj) is BackendLinear
    head = model.lm_head  # packed once for rollouts only: the log-prob passes read its weight in chunks
    assert type(head) is BackendLinear and head.decode_only and head.pack_once and not head.pack_per_product
    assert "LM head" in head.why
    assert no_instance_forward(model)  # the class computes, not a patched forward
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    model(input_ids=ids)
    assert len(counted_products) == 7 * layers  # outside a pass, each product on oneDNN as it runs
    counted_products.clear()
    with torch.no_grad(), packed_for_pass(model, rows=2):
        model(input_ids=ids)
    assert not counted_products  # inside a pass: the copy packed once, no per-product packing

    off, _ = load_policy("tiny")
    prepared(off, "off", trains=True)
    assert len(backend_linears(off)) == 7 * layers + 1
    assert not any(m.pack_per_product or m.pack_once for m in backend_linears(off))
    off(input_ids=ids)
    assert not counted_products  # plain products


def test_loras_narrow_matrices_keep_plain_products():
    model, _ = load_policy("tiny")
    model = prepared(lora.apply(model, lora.LoraSettings(enabled=True, rank=4, alpha=8)), "on", trains=True)
    assert len(backend_linears(model)) == 7 * model.config.num_hidden_layers + 1  # the frozen base layers and the head
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, LeanLoraLinear)
    assert type(layer.base_layer) is BackendLinear and layer.base_layer.pack_per_product
    assert type(layer.lora_A["default"]) is torch.nn.Linear and "LoRA adapter" in layer.lora_A["default"].why
    assert no_instance_forward(model)


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_a_training_pass_gives_the_plain_loss_and_gradients(adapters, counted_products):
    plain, _ = load_policy("tiny")
    if adapters:  # LoRA's layer adds its adapters' term to the packed base product in place
        plain = lora.apply(plain, lora.LoraSettings(enabled=True, rank=4, alpha=8))
        with torch.no_grad():
            for name, p in plain.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(2))
    packed = prepared(copy.deepcopy(plain), "on", trains=True)
    prepared(plain, "off", trains=True)
    ids = torch.randint(0, plain.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (plain, packed):
        loss = model(input_ids=ids).logits.float().log_softmax(-1).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    assert len(counted_products) == 7 * plain.config.num_hidden_layers  # the packed model's forward only
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    for name, g in grads0.items():
        assert (grads1[name] - g).abs().max() <= 1e-4 * g.abs().max(), name


# ------------------------------------------------------------------ packed once per pass (rollouts)
def test_packed_rollouts_match_the_default_matmul(smollm2):
    model, tok = smollm2  # the shared model stays plain: the packed one is a prepared copy
    packed_model = prepared(copy.deepcopy(model), "on")
    prompts = chat_prompt_ids(tok, QUESTIONS)

    def rollout(m, temperature, seed=0):
        engine = HFEngine(m, tok, max_new_tokens=16, seed=seed)
        return engine.generate(prompts, TemperatureExplorer(temperature), n=4)

    greedy_packed, greedy = rollout(packed_model, 0.0), rollout(model, 0.0)
    assert torch.equal(greedy_packed.response_ids, greedy.response_ids)
    assert torch.allclose(greedy_packed.rollout_logprobs, greedy.rollout_logprobs, atol=1e-4)
    sampled_packed, sampled = rollout(packed_model, 1.0, seed=3), rollout(model, 1.0, seed=3)
    same = (sampled_packed.response_ids == sampled.response_ids).all(-1)
    assert same.float().mean() >= 0.75  # a row may flip where a draw falls on a rounding boundary
    assert torch.allclose(sampled_packed.rollout_logprobs[same], sampled.rollout_logprobs[same], atol=1e-4)


def test_layers_are_packed_only_inside_the_block(tiny):
    model = prepared(copy.deepcopy(tiny[0]), "on")
    ids = torch.randint(0, model.config.vocab_size, (3, 7))
    with torch.no_grad():
        plain = model(ids).logits
        with packed_for_pass(model, rows=3) as count:
            assert count == packed_now(model) == 7 * model.config.num_hidden_layers
            assert model.lm_head._pass_weight is None  # not a rollout: the LM head multiplies by its plain weight
            packed = model(ids).logits
        assert packed_now(model) == 0 and not any(m._in_pass for m in backend_linears(model))
    assert not torch.equal(packed, torch.zeros_like(packed))
    torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-4)

    with pytest.raises(KeyError), packed_for_pass(model, rows=3):  # an error inside still unpacks
        raise KeyError("stop")
    assert packed_now(model) == 0 and not any(m._in_pass for m in backend_linears(model))
    assert no_instance_forward(model)


def test_training_after_a_packed_rollout_reaches_every_weight(tiny):
    model, tok = prepared(copy.deepcopy(tiny[0]), "on"), tiny[1]
    seen = []
    first = backend_linears(model)[0]
    hook = first.register_forward_pre_hook(lambda m, args: seen.append(m._pass_weight is not None))
    try:
        HFEngine(model, tok, max_new_tokens=4).generate(chat_prompt_ids(tok, QUESTIONS), TemperatureExplorer(1.0), n=2)
        assert seen and all(seen)  # every rollout forward ran packed
        model.zero_grad(set_to_none=True)
        model(torch.randint(0, model.config.vocab_size, (2, 5))).logits.square().mean().backward()
    finally:
        hook.remove()
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in linears(model))


def test_nothing_is_packed_when_off_or_unsupported(tiny):
    model, tok = prepared(copy.deepcopy(tiny[0]), "off"), tiny[1]
    seen = []
    hook = backend_linears(model)[0].register_forward_pre_hook(lambda m, args: seen.append(m._pass_weight is not None))
    try:
        engine = HFEngine(model, tok, max_new_tokens=3)
        engine.generate(chat_prompt_ids(tok, QUESTIONS), TemperatureExplorer(1.0), n=2)
    finally:
        hook.remove()
    assert seen and not any(seen)

    class Scaled(torch.nn.Linear):  # a subclass may compute something else: left alone
        def forward(self, x):
            return 2 * super().forward(x)

    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), Scaled(4, 4), torch.nn.Linear(4, 4).double())
    CPUBackend(packing="on").prepare(mixed)
    assert type(mixed[0]) is BackendLinear and mixed[0].pack_once
    assert type(mixed[1]) is Scaled
    assert type(mixed[2]) is BackendLinear and not mixed[2].pack_once and "cannot pack" in mixed[2].why
    with packed_for_pass(mixed, rows=2) as count:
        assert count == 1 and mixed[0]._pass_weight is not None and mixed[2]._pass_weight is None
    unpacked = CPUBackend(packing="off").prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with packed_for_pass(unpacked, rows=2) as count:
        assert count == 0
    with pytest.raises(ValueError, match=r"backend\.packing='yes'"):
        CPUBackend(packing="yes")
    with pytest.raises(TypeError, match="packed_weights"):  # a rollout's packing is the backend's choice
        HFEngine(model, tok, packed_weights=True)


def test_a_lora_layer_is_packed_merged_and_gives_the_adapted_output():
    peft = pytest.importorskip("peft")

    policy = trained_lora(std=0.5, dropout=0.1)  # its own model (peft adapts in place); merged != base
    prepared(policy, "on", trains=True)
    adapted = [m for m in policy.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert adapted and all(isinstance(m, LeanLoraLinear) for m in adapted)
    inner = {id(sub) for m in adapted for sub in m.modules() if isinstance(sub, torch.nn.Linear)}
    calls = []
    hooks = [m.register_forward_pre_hook(lambda m, args: calls.append(m)) for m in linears(policy)]
    ids = torch.randint(0, policy.config.vocab_size, (3, 7))
    policy.eval()
    try:
        with torch.no_grad():
            unmerged = policy(input_ids=ids).logits
            calls.clear()
            with packed_for_pass(policy, rows=3, decoding=True) as count:
                assert count == len(adapted) + 1  # one merged copy per adapted layer, and the LM head
                assert all(m._merged is not None and m._merged[2] for m in adapted)  # merged and packed
                merged = policy(input_ids=ids).logits
            assert calls and not any(id(m) in inner for m in calls)  # no base or adapter product ran
            with policy.disable_adapter(), packed_for_pass(policy, rows=3, decoding=True) as count:
                assert count == len(adapted) + 1  # adapters off: each base layer packed alone, and the head
                assert all(m._merged is None for m in adapted)
                base = policy(input_ids=ids).logits
            with policy.disable_adapter():
                expected_base = policy(input_ids=ids).logits
    finally:
        for hook in hooks:
            hook.remove()
    assert all(m._merged is None for m in adapted) and packed_now(policy) == 0  # unpacked after the block
    assert all(isinstance(m, LeanLoraLinear) for m in adapted) and no_instance_forward(policy)
    assert not torch.allclose(unmerged, expected_base, atol=1e-3)
    torch.testing.assert_close(merged, unmerged, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(base, expected_base, atol=1e-4, rtol=1e-4)
    trained = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)  # nothing was merged into the base
