"""The lean LoRA layer (``backends/lora.py``): its values against peft's layer (bit for bit in
float32; on a bfloat16 model with float32 adapters, as close to the float64 model as peft's), the
fused product's gradients, the adapters' cast copies, and the merged copy a rollout multiplies by."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from conftest import chat_prompt_ids, trained_lora

from ngrpo_lightning.models import lora
from ngrpo_lightning.models.loading import load_policy

peft = pytest.importorskip("peft")


def test_the_lean_training_forward_gives_peft_s_values_bit_for_bit():
    from peft.tuners.lora.layer import Linear

    from ngrpo_lightning.backends.lora import LeanLoraLinear, lean_lora_layers
    from ngrpo_lightning.backends.swap import original_class

    policy = trained_lora()
    assert lean_lora_layers(policy) == 7 * policy.config.num_hidden_layers
    ids = torch.randint(0, policy.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))

    def forward_backward():
        policy.zero_grad(set_to_none=True)
        logits = policy(input_ids=ids).logits
        logits.float().log_softmax(-1).mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    layers = [m for m in policy.modules() if isinstance(m, Linear)]
    assert layers and all(isinstance(m, LeanLoraLinear) and "forward" not in vars(m) for m in layers)
    assert lean_lora_layers(policy) == 0  # swapped once
    lean, lean_grads = forward_backward()
    for m in layers:
        m.__class__ = original_class(m)  # peft's own layer and forward
    assert all(type(m) is Linear for m in layers)
    peft_out, peft_grads = forward_backward()
    assert torch.equal(lean, peft_out)
    assert lean_grads.keys() == peft_grads.keys() and all(torch.equal(lean_grads[k], peft_grads[k]) for k in lean_grads)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"), id="on_a_gpu"
        ),
    ],
)
def test_float32_adapters_on_a_bfloat16_model_multiply_in_bfloat16_without_casting_activations(device):
    """peft keeps adapters in float32 on a bfloat16 model and casts every adapted layer's input to
    float32 and its sum back; the lean layer casts the small adapter weights instead (as autocast
    would). Those activation-sized casts are gone (the model's own, its norms', remain), and the
    outputs and the adapters' gradients are as close to the float64 model's as peft's are: the
    bfloat16 base model, not the adapter's rounding, sets the error."""
    import copy

    from peft.tuners.lora.layer import Linear
    from torch.utils._python_dispatch import TorchDispatchMode

    from ngrpo_lightning.backends.lora import lean_lora_layers
    from ngrpo_lightning.backends.swap import original_class

    # peft draws A from the global generator: seeded, so the bound below does not depend on the tests
    # run before (at some draws the adapters' largest gradient error passes 1.5x peft's: the fused
    # product at 1 of 26 seeds tried, the lean layer's earlier ops at 2 of 9)
    torch.manual_seed(0)
    policy = lora.apply(load_policy("tiny", dtype="bfloat16")[0], lora.LoraSettings(enabled=True, rank=16))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3, generator=torch.Generator().manual_seed(0))
    assert {p.dtype for n, p in policy.named_parameters() if p.requires_grad} == {torch.float32}  # peft's default
    policy.to(device)
    ids = torch.randint(0, policy.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(1)).to(device)

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._to_copy:
                self.sizes.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    def forward_backward(model):
        model.zero_grad(set_to_none=True)
        with Casts() as casts:
            logits = model(input_ids=ids).logits
        logits.float().log_softmax(-1).mean().backward()
        grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach().double(), grads, casts.sizes

    truth, truth_grads, _ = forward_backward(copy.deepcopy(policy).double())
    layers = [m for m in policy.modules() if isinstance(m, Linear)]
    peft_out, peft_grads, peft_casts = forward_backward(policy)
    lean_lora_layers(policy)
    assert all(type(m) is not original_class(m) for m in layers)
    lean, lean_grads, lean_casts = forward_backward(policy)
    activation = ids.numel() * policy.config.hidden_size
    wide = [sum(size >= activation for size in casts) for casts in (lean_casts, peft_casts)]
    assert wide[1] - wide[0] >= len(layers)  # peft cast each adapted layer's input to float32 (and most sums back)

    def error(value, reference):
        return float((value - reference).norm() / reference.norm())

    assert error(lean, truth) <= 1.5 * error(peft_out, truth)
    assert lean_grads.keys() == peft_grads.keys() == truth_grads.keys()
    lean_errors = [error(lean_grads[k], truth_grads[k]) for k in truth_grads]
    peft_errors = [error(peft_grads[k], truth_grads[k]) for k in truth_grads]
    assert max(lean_errors) <= 1.5 * max(peft_errors) and sum(lean_errors) <= 1.5 * sum(peft_errors)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradient_checkpointing_gives_the_adapters_the_same_gradients(dtype):
    """Lean layers on either path: peft's ops (float32) and the fused product (float32 adapters on
    a bfloat16 model), the prepared model's recomputation inside."""
    from ngrpo_lightning.backends import Backend

    policy = trained_lora() if dtype == "float32" else trained_lora(std=0.3).to(torch.bfloat16)
    if dtype == "bfloat16":
        for p in policy.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # peft's float32 adapters on the bfloat16 model
    Backend(dtype=getattr(torch, dtype)).prepare(policy, trains=True)
    ids = torch.randint(0, policy.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    embeds = policy.get_input_embeddings()(ids)  # frozen: the checkpointed layers' input needs no gradient

    def grads():
        policy.zero_grad(set_to_none=True)
        policy(inputs_embeds=embeds).logits.float().log_softmax(-1).mean().backward()
        return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    policy.train()
    plain = grads()
    policy.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False}
    )  # as model.gradient_checkpointing
    checkpointed = grads()
    assert plain and plain.keys() == checkpointed.keys()
    assert any(g.abs().sum() > 0 for g in checkpointed.values())
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7)
    if dtype == "bfloat16":
        adapted = next(m for m in policy.modules() if isinstance(m, peft.tuners.lora.LoraLayer))
        # one node per layer, the frozen base product inside it
        assert type(adapted(embeds).grad_fn).__name__ == "LoraLinearProductBackward"


def test_an_unpacked_rollout_multiplies_by_merged_weights():
    """Where nothing is packed (a GPU rollout; here the CPU backend with packing off), each adapted
    layer still runs one product per token, on W + scale B A: no base or adapter product runs,
    the rollout is the adapted policy's, and the training forward is back afterwards."""
    from ngrpo_lightning.backends import CPUBackend
    from ngrpo_lightning.backends.lora import LeanLoraLinear
    from ngrpo_lightning.explorers import TemperatureExplorer
    from ngrpo_lightning.models.loading import load_tokenizer
    from ngrpo_lightning.rollout import HFEngine

    policy, tok = trained_lora(std=0.5), load_tokenizer("tiny")
    CPUBackend(packing="off").prepare(policy, trains=True)
    adapted = [m for m in policy.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    inner = [sub for m in adapted for sub in m.modules() if isinstance(sub, torch.nn.Linear)]
    engine = HFEngine(policy, tok, max_new_tokens=6)
    prompts = chat_prompt_ids(tok, ["What is 7 + 5?", "What is 3 * 4?"])
    calls = []
    hooks = [m.register_forward_pre_hook(lambda m, args: calls.append(m)) for m in inner]
    try:
        merged = engine.generate(prompts, TemperatureExplorer(0.0), n=2)
    finally:
        for hook in hooks:
            hook.remove()
    assert not calls  # one merged product per adapted layer
    with mock.patch.object(LeanLoraLinear, "merge_adapter_name", lambda module: None):  # three products
        unmerged = engine.generate(prompts, TemperatureExplorer(0.0), n=2)
    assert torch.equal(merged.response_ids, unmerged.response_ids)
    torch.testing.assert_close(merged.rollout_logprobs, unmerged.rollout_logprobs, atol=1e-4, rtol=1e-4)
    assert all(isinstance(m, LeanLoraLinear) and m._merged is None for m in adapted)  # the training forward
    assert not any("forward" in vars(m) for m in policy.modules())


def test_the_fused_lora_product_s_gradients_are_the_derivatives_of_its_output():
    """``LoraProduct`` (float32 adapters on a half model) writes ``base + scale B A x_a`` into
    ``base`` and computes its own backward: checked against finite differences in float64, with
    the adapter's input apart from the base's (dropout) and rows of more than one dimension."""
    from ngrpo_lightning.backends.lora import LoraProduct

    g = torch.Generator().manual_seed(0)
    base, x_a = torch.randn(2, 3, 5, generator=g, dtype=torch.float64), torch.randn(2, 3, 4, generator=g).double()
    A, B = torch.randn(2, 4, generator=g).double(), torch.randn(5, 2, generator=g).double()
    for t in (base, x_a, A, B):
        t.requires_grad_()

    def product(base, x_a, A, B):  # in float64 the copies that multiply are the parameters' values
        return LoraProduct.apply(base.clone(), x_a, A.detach(), B.detach(), A, B, 0.75)

    with torch.no_grad():
        expected = base + 0.75 * x_a @ A.t() @ B.t()
    torch.testing.assert_close(product(base, x_a, A, B), expected)
    assert torch.autograd.gradcheck(product, (base, x_a, A, B))


def test_the_lora_linear_product_s_gradients_are_the_derivatives_of_its_output():
    """``LoraLinearProduct`` computes the frozen base product too and writes the adapter's share of
    the input's gradient into the base's: checked against finite differences in float64, with and
    without a bias, the frozen weight and bias given no gradient."""
    from ngrpo_lightning.backends.lora import LoraLinearProduct

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    W, b = torch.randn(5, 4, generator=g).double(), torch.randn(5, generator=g).double()
    A = torch.randn(2, 4, generator=g).double().requires_grad_()
    B = torch.randn(5, 2, generator=g).double().requires_grad_()
    for bias in (b, None):

        def product(x, A, B, bias=bias):
            return LoraLinearProduct.apply(x, W, bias, A.detach(), B.detach(), A, B, 0.75)

        with torch.no_grad():
            expected = torch.nn.functional.linear(x, W, bias) + 0.75 * x @ A.t() @ B.t()
        torch.testing.assert_close(product(x, A, B), expected)
        assert torch.autograd.gradcheck(product, (x, A, B))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"), id="on_a_gpu"
        ),
    ],
)
def test_the_adapter_s_gradients_are_products_in_its_own_dtype(device):
    """``product_in``: ``alpha * a @ b`` of half inputs in float32, the value of the product cast
    after (the CPU's way; a GPU's products write float32 themselves)."""
    from ngrpo_lightning.backends.lora import product_in

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 9, generator=g).bfloat16().to(device), torch.randn(9, 4, generator=g).bfloat16().to(device)
    for alpha in (1.0, 0.5):
        out = product_in(torch.float32, a, b, alpha)
        assert out.dtype == torch.float32 and out.shape == (6, 4)
        torch.testing.assert_close(out, (alpha * (a.float() @ b.float())), rtol=1e-2, atol=1e-2)


def test_the_base_product_goes_into_the_adapter_s_node_only_when_it_is_a_frozen_plain_product():
    """The base layer's product moves into ``LoraLinearProduct`` only where its forward is
    ``F.linear`` on weights nothing trains: not a layer with hooks, a trained weight or bias, or a
    CPU backend's packed products."""
    from ngrpo_lightning.backends.lora import frozen_product
    from ngrpo_lightning.backends.packing import BackendLinear

    def frozen(**change):
        layer = torch.nn.Linear(4, 3)
        layer.requires_grad_(False)
        if "packed" in change:
            BackendLinear.swap_in(layer, pack_once=False, pack_per_product=change["packed"], why="test")
        if change.get("bias_trained"):
            layer.bias.requires_grad_(True)
        if change.get("hooked"):
            layer.register_forward_hook(lambda *args: None)
        return frozen_product(layer)

    weight, bias = frozen()
    assert weight.shape == (3, 4) and bias.shape == (3,)
    assert frozen(packed=False) is not None
    assert frozen(packed=True) is None and frozen(bias_trained=True) is None and frozen(hooked=True) is None
    trained = torch.nn.Linear(4, 3)
    assert frozen_product(trained) is None


def test_float32_adapters_are_cast_once_per_change_and_never_read_stale():
    """On a bfloat16 model the lean layers keep their adapters' bfloat16 copies from one pass to the
    next (a step's log-prob pass and its update's micro-batches cast nothing again) and cast them
    anew once an optimizer step or a load changes the adapters: the output after the step is the
    one a layer that had never cast gives, bit for bit, and differs from the one before."""
    from peft.tuners.lora.layer import Linear
    from torch.utils._python_dispatch import TorchDispatchMode

    from ngrpo_lightning.backends import Backend

    policy = lora.apply(load_policy("tiny", dtype="bfloat16")[0], lora.LoraSettings(enabled=True, rank=4))
    Backend(dtype=torch.bfloat16).prepare(policy, trains=True)
    layers = [m for m in policy.modules() if isinstance(m, Linear)]
    ids = torch.randint(0, policy.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    adapter_sizes = {p.numel() for n, p in policy.named_parameters() if p.requires_grad}

    class Casts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._to_copy and args[0].numel() in adapter_sizes:
                self.count += 1
            return func(*args, **(kwargs or {}))

    def forward(grad=True):
        with Casts() as casts, torch.set_grad_enabled(grad):
            logits = policy(input_ids=ids).logits
        return logits, casts.count

    first, casts = forward()
    assert casts == 2 * len(layers)
    assert first.grad_fn is not None and all(m._cast is not None for m in layers)
    first.float().logsumexp(-1).mean().backward()
    again, casts = forward(grad=False)
    assert casts == 0 and torch.equal(again, first.detach())
    torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=10.0).step()
    stepped, casts = forward(grad=False)
    assert casts == 2 * len(layers) and not torch.equal(stepped, first.detach())
    for m in layers:
        m._cast_key = None  # as if never cast
    assert torch.equal(forward(grad=False)[0], stepped)
    zero_b = {n: torch.zeros_like(p) for n, p in policy.named_parameters() if "lora_B" in n}
    policy.load_state_dict(zero_b, strict=False)
    loaded, casts = forward(grad=False)
    assert casts == 2 * len(layers)  # B loaded in place: cast again
    with lora.adapters_off(policy), torch.no_grad():
        assert torch.equal(loaded, policy(input_ids=ids).logits)  # B = 0: the base model's outputs


def test_the_fused_product_leaves_to_peft_what_it_does_not_fuse_and_keeps_peft_s_dropout():
    """The fused product reads the layer's state directly (no peft properties): adapters off or
    merged, several active, an adapter bias or adapters already in the inputs' dtype go to peft's
    forward or the lean loop; a dropout draws the mask peft's forward draws."""
    from ngrpo_lightning.backends.lora import lean_lora_layers
    from ngrpo_lightning.backends.swap import original_class

    policy = lora.apply(load_policy("tiny", dtype="bfloat16")[0], lora.LoraSettings(enabled=True, rank=8))
    lean_lora_layers(policy)
    layer = policy.base_model.model.model.layers[0].self_attn.q_proj
    bf16 = torch.bfloat16
    assert layer._fused_parts(bf16) is not None and layer._fused_parts(torch.float32) is None
    layer.lora_bias["default"] = True
    assert layer._fused_parts(bf16) is None
    layer.lora_bias["default"] = False
    layer._active_adapter = ["default", "other"]
    assert layer._fused_parts(bf16) is None
    layer._active_adapter = "default"
    layer.enable_adapters(False)
    assert layer._fused_parts(bf16) is None
    layer.enable_adapters(True)
    layer.merged_adapters = ["default"]
    assert layer._fused_parts(bf16) is None
    layer.merged_adapters = []

    layer.lora_dropout["default"] = torch.nn.Dropout(0.5)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, 3, layer.in_features, generator=torch.Generator().manual_seed(1)).to(bf16)
    outputs = {}
    for name, cls in (("lean", type(layer)), ("peft", original_class(layer))):
        layer.__class__ = cls
        torch.manual_seed(2)
        outputs[name] = layer(x).float()
    layer.lora_dropout["default"] = torch.nn.Identity()
    undropped = layer(x).float()
    gap = (outputs["lean"] - outputs["peft"]).abs().max()
    assert gap < 0.05 * outputs["peft"].abs().max() < (outputs["peft"] - undropped).abs().max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapters_with_a_bias_run_peft_s_forward(dtype):
    """peft's ``lora_bias`` gives B a bias the lean layer's products leave out: such layers keep
    peft's forward, in either dtype."""
    from ngrpo_lightning.backends.lora import lean_lora_layers
    from ngrpo_lightning.backends.swap import original_class

    model = load_policy("tiny", dtype=dtype)[0]
    policy = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_bias=True, target_modules=["q_proj"]))
    lean_lora_layers(policy)
    layer = policy.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["default"].bias.normal_(generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 3, layer.in_features, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
    lean = layer(x)
    layer.__class__ = original_class(layer)
    assert torch.equal(lean, layer(x))
