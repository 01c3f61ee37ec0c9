"""The CUDA backend's joined projections, checked on the CPU: q, k, v and gate, up as one product
in rollouts (on weights joined in place, or one copy with LoRA's merged weights written into it),
the residual sums inside the products, and the training passes' one product per group
(``JointLinear``, LoRA's ``JointLoraProduct``) with each parameter's own gradient; kernel counts
and out_dtype gradients on a GPU are checked by the GPU tests (``-k on_a_gpu``)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_fused import attentions, mlps, small_shape
from torch.utils._python_dispatch import TorchDispatchMode

from ngrpo_lightning.backends.cuda import CUDABackend
from ngrpo_lightning.backends.fused import FusedRotaryAttention


class Products(TorchDispatchMode):
    """Counts the matrix products and the sums dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.count = self.adds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
        self.adds += func.overloadpacket is torch.ops.aten.add
        return func(*args, **(kwargs or {}))


class KeepsActivations(CUDABackend):
    """The CUDA backend's choices on a GPU large enough to keep the MLPs' activations (the CPU,
    with no GPU to weigh them against, has its MLPs recompute them)."""

    def __init__(self, *args, **kwargs):  # with fewer kernels per layer, off by default until measured on a GPU
        super().__init__(*args, enable=["fewer_kernels_per_layer"], **kwargs)

    def recomputes(self, model: torch.nn.Module) -> bool:
        return False


def qwen2_with_biases():
    """A small random Qwen2 whose q, k and v biases are not zero (transformers starts them at 0)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**small_shape(attn_implementation="sdpa")))
    with torch.no_grad():
        for a in attentions(model):
            for p in (a.q_proj, a.k_proj, a.v_proj):
                p.bias.normal_()
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2-biases", "lora"])
def test_inside_a_rollout_queries_keys_and_values_come_from_one_product(tiny, arch):
    """In a rollout (``packed_for_pass`` decoding) a fused attention multiplies by one concatenated
    copy of q, k and v (LoRA's merged copies written into it): two products and a concatenation
    fewer per layer, the same outputs (float32 roundings), the copy gone after the pass unless kept,
    and a projection with a hook left to its own forward."""
    from conftest import trained_lora

    from ngrpo_lightning.backends.passes import packed_for_pass

    torch.manual_seed(0)
    if arch == "llama":
        model = copy.deepcopy(tiny[0])
    elif arch == "lora":
        model = trained_lora()
    else:
        model = qwen2_with_biases()
    CUDABackend(torch.float32, enable=["fewer_kernels_per_layer"]).prepare(model.eval())
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))

    def forward():
        with Products() as products, torch.no_grad():
            logits = model(input_ids=ids).logits
        forward.adds = products.adds
        return logits, products.count

    plain, plain_products = forward()
    plain_adds = forward.adds
    with packed_for_pass(model, rows=2, decoding=True):
        merged, merged_products = forward()
        attention = next(m for m in model.modules() if isinstance(m, FusedRotaryAttention))
        weight = attention._joint[0]
    # per layer q|k|v, o, gate, up, down, and the head; LoRA's gate|up is one product too (merged copies
    # written into one; outside a rollout three products each), a frozen model's plain gate and up are not
    # copied for it (nothing here trains: its weights were not joined)
    merged_per_layer = 4 if arch == "lora" else 5
    assert merged_products == merged_per_layer * layers + 1
    # the residual sums made by the products: o's always, down's where the MLP is one product too
    assert plain_adds - forward.adds == (2 if arch == "lora" else 1) * layers
    assert plain_products == (7 if arch != "lora" else 21) * layers + 1
    torch.testing.assert_close(merged, plain, rtol=1e-5, atol=1e-5)
    assert weight.shape[0] == sum(p.out_features for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    assert attention._joint is None and attention._joint_kept is None
    if arch == "lora":
        assert attention.q_proj._merged is None and attention.q_proj._kept is None  # went with the copy
    hook = attention.k_proj.register_forward_hook(lambda *args: None)
    with packed_for_pass(model, rows=2, decoding=True):
        assert attention._joint is None  # a hook on k_proj: three products, as the model defines them
        assert (
            sum(a._joint is not None for a in attentions(model.base_model.model if arch == "lora" else model))
            == layers - 1
        )
    hook.remove()


@pytest.mark.parametrize("arch", ["llama", "qwen2-biases"])
def test_a_trained_model_s_projections_are_joined_and_a_rollout_reads_them_in_place(tiny, arch, tmp_path):
    """On its device the CUDA backend re-homes a policy's q, k, v (and biases) and gate, up weights as
    row blocks of one tensor (``on_device``; a second call moves nothing): the same parameters,
    state dict and saved model, the same optimizer steps as the model not joined; in a rollout
    q|k|v and gate|up are one product each, read in place (no copy), so after an optimizer step the
    next rollout multiplies by the new weights."""
    from transformers import AutoModelForCausalLM

    from ngrpo_lightning.backends.joined import rows_of_one_tensor
    from ngrpo_lightning.backends.passes import packed_for_pass

    torch.manual_seed(0)
    if arch == "llama":
        model = copy.deepcopy(tiny[0])
    else:
        model = qwen2_with_biases()
    before = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    backend = KeepsActivations(torch.float32)
    backend.on_device(backend.prepare(model, trains=True))  # as RLModule.on_fit_start does
    own = copy.deepcopy(model)  # the same modules, each weight in a storage of its own (a deep copy)
    assert rows_of_one_tensor([mlps(own)[0].gate_proj.weight, mlps(own)[0].up_proj.weight]) is None
    assert [n for n, _ in model.named_parameters()] == names
    joint = mlps(model)[0].gate_proj.weight.data_ptr()
    backend.on_device(model)  # joined already: nothing moves
    assert mlps(model)[0].gate_proj.weight.data_ptr() == joint
    for a, m in zip(attentions(model), mlps(model), strict=True):
        assert rows_of_one_tensor([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]) is not None
        assert rows_of_one_tensor([m.gate_proj.weight, m.up_proj.weight]) is not None
        if arch != "llama":
            assert rows_of_one_tensor([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) is not None
    for (name, a), b in zip(model.state_dict().items(), before.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    passes = []
    for m in (model, own):  # two micro-batches and an optimizer step each: the views train as separate parameters
        opt = torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)  # linear in the gradients: AdamW's
        # first step is about lr * sign(g), which turns a rounding of a near-zero gradient into lr
        with Products() as products:
            for rows in (slice(0, 1), slice(1, 2)):  # gradients accumulate into the joined rows too
                m(input_ids=ids[rows]).logits.square().mean().backward()
        passes.append(products.count)
        grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        m.grads = grads
    for (name, a), b in zip(model.named_parameters(), own.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    for name, a, b in zip(names, model.grads, own.grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7, msg=name)
    # a training pass multiplies q|k|v and gate|up as one product each way: per layer and micro-batch
    # 3 + 2 products fewer forward, (2 + 1) x 2 fewer backward (input's and weights' gradients)
    assert passes[1] - passes[0] == 2 * 9 * model.config.num_hidden_layers
    assert rows_of_one_tensor([mlps(model)[0].gate_proj.weight, mlps(model)[0].up_proj.weight]) is not None

    model.eval()
    with Products() as outside, torch.no_grad():
        model(input_ids=ids)
    with packed_for_pass(model, rows=2, decoding=True), Products() as products, torch.no_grad():
        merged = model(input_ids=ids).logits
        attention, mlp = attentions(model)[0], mlps(model)[0]
        assert attention._joint[0].data_ptr() == attention.q_proj.weight.data_ptr()  # the parameters' own rows
        assert mlp._joint[0].data_ptr() == mlp.gate_proj.weight.data_ptr()
    assert products.count == 4 * model.config.num_hidden_layers + 1  # q|k|v, o, gate|up, down; the head
    assert outside.adds - products.adds == 2 * model.config.num_hidden_layers  # both residual sums in products
    assert attention._joint_kept is None and mlp._joint_kept is None  # nothing copied, nothing kept
    with torch.no_grad():
        torch.testing.assert_close(merged, own.eval()(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path, safe_serialization=True)  # the joined tensor saves as separate weights
    saved = AutoModelForCausalLM.from_pretrained(tmp_path)
    for (name, a), b in zip(saved.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_weights_moved_since_they_were_joined_are_multiplied_apart_not_copied(tiny):
    """A gated MLP never copies plain weights for a rollout: weights no longer row blocks of one
    tensor (moved or replaced after the backend joined them) are multiplied as the model defines them."""
    from ngrpo_lightning.backends.passes import packed_for_pass

    model = copy.deepcopy(tiny[0])
    backend = CUDABackend(torch.float32, enable=["fewer_kernels_per_layer"])
    backend.on_device(backend.prepare(model, trains=True))
    mlp = mlps(model)[0]
    with torch.no_grad():
        mlp.up_proj.weight.data = mlp.up_proj.weight.detach().clone()  # as a move to another device would
    with packed_for_pass(model, rows=2, decoding=True):
        assert mlp._joint is None and mlps(model)[1]._joint is not None


def test_a_joint_product_s_gradients_go_to_each_block_s_own_parameter():
    """``JointLinear``: one product over weights (and biases) that are row blocks of one tensor,
    each block's gradient its parameter's: checked against finite differences in float64, with a
    frozen block given none, and its value ``F.linear`` on the blocks concatenated."""
    from ngrpo_lightning.backends.joined import JointLinear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight, bias = torch.randn(9, 4, generator=g).double(), torch.randn(9, generator=g).double()
    blocks = [weight[:4], weight[4:6], weight[6:]]  # q, k, v-like blocks of one tensor
    parts = [bias[:4], bias[4:6], bias[6:]]
    params = [t.clone().requires_grad_(i != 1) for i, t in enumerate(blocks + parts)]  # k's weight frozen

    def joint(x, *params):
        return JointLinear.apply(x, torch.cat(params[:3]).detach(), torch.cat(params[3:]).detach(), 3, *params)

    expected = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(joint(x, *params), expected)
    assert torch.autograd.gradcheck(joint, (x, *params))
    joint(x, *params).sum().backward()
    assert params[1].grad is None and params[0].grad.shape == (4, 4) and params[4].grad.shape == (2,)


def test_lora_layers_reading_one_input_are_one_node_with_the_gradients_of_the_layers_apart():
    """``JointLoraProduct``: q, k, v (and gate, up) LoRA layers with frozen base weights joined, their
    A's stacked and B's in one block-diagonal matrix: checked against finite differences in float64
    with three adapters of different ranks, widths and scales."""
    from ngrpo_lightning.backends.joined import JointLoraProduct

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    widths, ranks, scales = [4, 2, 3], [2, 3, 1], [0.5, 2.0, 1.5]
    weight, bias = torch.randn(sum(widths), 5, generator=g).double(), torch.randn(sum(widths), generator=g).double()
    A = [torch.randn(r, 5, generator=g).double().requires_grad_() for r in ranks]
    B = [torch.randn(w, r, generator=g).double().requires_grad_() for w, r in zip(widths, ranks, strict=True)]

    def joint(x, *params, scales=scales):  # several scales: each block scaled, alpha 1
        As, Bs = params[:3], params[3:]
        blocks = torch.block_diag(*(s * b.detach() for s, b in zip(scales, Bs, strict=True)))
        down = torch.cat([a.detach() for a in As])
        return JointLoraProduct.apply(x, weight, bias, down, blocks, scales, 1.0, *params)

    def one_scale(x, *params):  # one scale for all: the blocks are the B's, the products apply it
        blocks = torch.block_diag(*(b.detach() for b in params[3:]))
        down = torch.cat([a.detach() for a in params[:3]])
        return JointLoraProduct.apply(x, weight, bias, down, blocks, [0.75] * 3, 0.75, *params)

    for function, used in ((joint, scales), (one_scale, [0.75] * 3)):
        with torch.no_grad():
            apart = [
                torch.nn.functional.linear(x, w, b) + s * x @ a.t() @ bb.t()
                for w, b, a, bb, s in zip(weight.split(widths), bias.split(widths), A, B, used, strict=True)
            ]
        torch.testing.assert_close(function(x, *A, *B), torch.cat(apart, -1))
        assert torch.autograd.gradcheck(function, (x, *A, *B))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"), id="on_a_gpu"
        ),
    ],
)
def test_a_lora_policy_s_training_pass_multiplies_each_group_as_one_node(tiny, device):
    """On a bfloat16 policy with float32 adapters (peft's default on a GPU) the CUDA backend joins
    the frozen base weights of q, k, v and of gate, up once on the device; a training pass then runs
    each group as one node (``JointLoraProduct``): fewer products, the same outputs and adapter
    gradients as the layers apart up to bfloat16 rounding; the reference pass (adapters off), run
    first as in a training step, multiplies each group's base weights as one product and leaves
    the adapters' pass its one node."""
    from conftest import trained_lora

    from ngrpo_lightning.backends.joined import rows_of_one_tensor
    from ngrpo_lightning.models import lora

    policy = trained_lora(std=0.3).to(torch.bfloat16)
    for p in policy.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # peft's float32 adapters on the bfloat16 model
    backend = KeepsActivations(torch.bfloat16)
    backend.prepare(policy, trains=True).to(device)
    apart = copy.deepcopy(policy)  # its base weights each in a storage of its own: the layers run apart
    backend.on_device(policy)  # on the GPU: the adapters' float32 gradients written by their products
    base = policy.base_model.model
    attention = attentions(base)[0]
    assert (
        rows_of_one_tensor([p.base_layer.weight for p in (attention.q_proj, attention.k_proj, attention.v_proj)])
        is not None
    )
    ids = torch.randint(0, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3)).to(device)
    runs = []
    for model in (policy, apart):
        model.train()
        model.zero_grad(set_to_none=True)
        with torch.no_grad(), lora.adapters_off(model), Products() as reference:  # first, as in a step
            off = model(input_ids=ids).logits.float()
        with Products() as forward:
            logits = model(input_ids=ids).logits.float()
        with Products() as backward:
            logits.log_softmax(-1).mean().backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        runs.append((logits.detach(), grads, (forward.count, backward.count), off, reference.count))
    (logits, grads, products, off, reference), (logits0, grads0, products0, off0, reference0) = runs
    layers = base.config.num_hidden_layers
    # per layer forward: q|k|v's base and A products once, where each layer made its own (2 x 2
    # fewer), gate|up's (2 fewer), the B sums likewise (addmm_, uncounted); backward fewer still
    assert products0[0] - products[0] == 6 * layers and products0[1] - products[1] >= 6 * layers
    assert reference0 - reference == 3 * layers  # adapters off: one base product per group
    torch.testing.assert_close(logits, logits0, rtol=0, atol=0.01 * logits0.abs().max().item())
    torch.testing.assert_close(off, off0, rtol=0, atol=0.01 * off0.abs().max().item())
    assert grads.keys() == grads0.keys() and grads
    for name in grads0:  # bfloat16 products in a different order: a relative bound, per adapter
        assert (grads[name] - grads0[name]).norm() <= 0.05 * grads0[name].norm(), name


def test_a_plain_linear_multiplies_by_its_own_weight_now_or_in_every_pass():
    """``plain_linear``: what the joins (kept from pass to pass) and LoRA's base product (this pass)
    ask of a layer. Hooks, per-product packing outside a pass and a rollout's packed copy say no."""
    from ngrpo_lightning.backends.packing import BackendLinear, packing_available, plain_linear
    from ngrpo_lightning.backends.passes import packed_for_pass

    layer = torch.nn.Linear(4, 3)
    assert plain_linear(layer) and plain_linear(layer, every_pass=True)
    layer.register_forward_pre_hook(lambda *args: None)
    assert not plain_linear(layer)
    per_product = BackendLinear.swap_in(torch.nn.Linear(4, 3), pack_once=False, pack_per_product=True, why="test")
    once = BackendLinear.swap_in(torch.nn.Linear(4, 3), pack_once=True, pack_per_product=False, why="test")
    assert not plain_linear(per_product) and plain_linear(once) and not plain_linear(once, every_pass=True)
    if packing_available(torch.float32):
        with packed_for_pass(torch.nn.Sequential(per_product, once), rows=2, decoding=True):
            assert plain_linear(per_product) and not plain_linear(once)  # F.linear; the packed copy
            assert not plain_linear(per_product, every_pass=True)
        assert not plain_linear(per_product) and plain_linear(once)
