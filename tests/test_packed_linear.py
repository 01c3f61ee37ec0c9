"""The policy's linear layers on oneDNN-packed products (``optim.packed_weights``): values and
gradients equal to plain products' to float rounding; which layers take them; the rest unchanged."""

import copy

import pytest
import torch

from ngrpo_lightning import lora
from ngrpo_lightning.models import load_policy
from ngrpo_lightning.packed_linear import PackedLinearFunction, packed_training
from ngrpo_lightning.rollout.packed_weights import packing_available

pytestmark = pytest.mark.skipif(not packing_available(torch.float32), reason="this CPU build has no oneDNN packing")


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


def test_a_frozen_weight_keeps_no_input_and_gets_no_gradient():
    x = torch.randn(5, 64, requires_grad=True)
    w = torch.randn(64, 64)  # LoRA's base layer: frozen
    y = PackedLinearFunction.apply(x, w, None)
    (gx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, torch.ones(5, 64) @ w, rtol=1e-5, atol=1e-5)


def test_the_decoder_linears_take_them_for_the_block_only():
    model, _ = load_policy("tiny")
    layers = model.config.num_hidden_layers
    with packed_training(model) as n:
        assert n == 7 * layers  # q, k, v, o, gate, up, down; not the LM head
        assert "forward" in vars(model.model.layers[0].self_attn.q_proj)
        assert "forward" not in vars(model.lm_head)
    assert not any("forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))
    with packed_training(model, enabled=False) as n:
        assert n == 0
    with packed_training(copy.deepcopy(model).to(torch.bfloat16)) as n:
        assert n == 0  # bfloat16 products are as fast unpacked


def test_loras_narrow_matrices_keep_plain_products():
    model, _ = load_policy("tiny")
    model = lora.apply(model, lora.LoraSettings(enabled=True, rank=4, alpha=8))
    with packed_training(model) as n:
        assert n == 7 * model.config.num_hidden_layers  # the frozen base layers only
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        assert "forward" in vars(layer.base_layer) and "forward" not in vars(layer.lora_A["default"])


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_a_training_pass_gives_the_plain_loss_and_gradients(adapters):
    plain, _ = load_policy("tiny")
    if adapters:  # LoRA's layer adds its adapters' term to the packed base product in place
        plain = lora.apply(plain, lora.LoraSettings(enabled=True, rank=4, alpha=8))
        with torch.no_grad():
            for name, p in plain.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(2))
    packed = copy.deepcopy(plain)
    ids = torch.randint(0, plain.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    results = []
    for model, enabled in ((plain, False), (packed, True)):
        with packed_training(model, enabled=enabled):
            loss = model(input_ids=ids).logits.float().log_softmax(-1).mean()
            loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    for name, g in grads0.items():
        assert (grads1[name] - g).abs().max() <= 1e-4 * g.abs().max(), name
