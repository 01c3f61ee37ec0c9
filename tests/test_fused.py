"""The CUDA backend's fused norms and rotary embeddings and its choice of recomputation, checked on
the CPU (where ``torch.nn.functional.rms_norm`` runs as its composite of the same steps); the
kernel count of the fused norm on a GPU is checked by the GPU tests (``-k on_a_gpu``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ngrpo_lightning.backends.base import Backend
from ngrpo_lightning.backends.cuda import CUDABackend
from ngrpo_lightning.backends.fused import (
    FusedDecoderLayer,
    FusedGatedMLP,
    FusedRMSNorm,
    FusedRotaryAttention,
    fused_mlps,
    fused_modules,
)
from ngrpo_lightning.backends.recompute import RecomputingGatedMLP, RecomputingRMSNorm, recomputes
from ngrpo_lightning.backends.swap import describe, original_class


def norms(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def small_shape(**overrides) -> dict:
    """A small decoder's config keys (grouped heads), with ``overrides``."""
    shape = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
    )
    return shape | overrides


def attentions(model):
    return [layer.self_attn for layer in model.model.layers]


def mlps(model):
    return [layer.mlp for layer in model.model.layers]


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


def same_outputs_and_gradients(own, fused, rtol=1e-5, atol=1e-6):
    ids = torch.randint(0, own.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    a, b = own(input_ids=ids, attention_mask=mask).logits, fused(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(b, a, rtol=rtol, atol=atol)
    a.square().mean().backward()
    b.square().mean().backward()
    for (name, p), q in zip(own.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=10 * rtol, atol=atol / 10, msg=name)


def test_fused_norms_and_rotation_give_transformers_outputs_and_gradients(tiny):
    model, _ = tiny
    own, fused = copy.deepcopy(model), copy.deepcopy(model)
    layers = len(fused.model.layers)
    assert fused_modules(fused) == len(norms(fused)) + 2 * layers == 4 * layers + 1  # norms, attentions, layers
    assert fused_mlps(fused) == layers and fused_mlps(fused) == 0
    pairs = zip(norms(fused) + attentions(fused) + mlps(fused), norms(own) + attentions(own) + mlps(own), strict=True)
    kinds = (FusedRMSNorm, FusedRotaryAttention, FusedGatedMLP)
    assert all(isinstance(layer, FusedDecoderLayer) for layer in fused.model.layers)
    assert all(isinstance(m, kinds) and original_class(m) is type(n) for m, n in pairs)
    same_outputs_and_gradients(own, fused)
    assert fused_modules(fused) == 0  # idempotent


def test_qwen2_s_attention_is_fused_and_qwen3_s_with_its_query_norms_is_not():
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = small_shape(attn_implementation="sdpa")
    torch.manual_seed(0)
    qwen2 = Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    fused = copy.deepcopy(qwen2)
    fused_modules(fused)
    assert all(isinstance(a, FusedRotaryAttention) for a in attentions(fused))  # biases, a sliding window key
    same_outputs_and_gradients(qwen2, fused)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16)).eval()
    fused_modules(qwen3)
    assert not any(isinstance(a, FusedRotaryAttention) for a in attentions(qwen3))  # its q_norm, k_norm left out
    assert all(isinstance(m, FusedRMSNorm) for m in norms(qwen3))


def test_rollouts_of_a_fused_model_are_the_plain_model_s(tiny):
    """Greedy rollouts of the tiny model, fused or not, on the growing cache and on the static one
    (the step as the CUDA backend records it, run without a graph)."""
    from conftest import chat_prompt_ids

    from ngrpo_lightning.explorers import TemperatureExplorer
    from ngrpo_lightning.rollout import HFEngine

    model, tok = tiny
    fused = copy.deepcopy(model)
    fused_modules(fused)
    prompts = chat_prompt_ids(tok, ["What is 7 + 5?", "Name a prime number larger than ten."])
    runs = [
        HFEngine(m, tok, max_new_tokens=10, seed=0, static_cache=static, graphs="rerun" if static else False).generate(
            prompts, TemperatureExplorer(temperature=0.0), n=2
        )
        for m in (model, fused)
        for static in (False, True)
    ]
    for run in runs[1:]:
        assert torch.equal(run.response_ids, runs[0].response_ids)
        torch.testing.assert_close(run.rollout_logprobs, runs[0].rollout_logprobs, rtol=1e-4, atol=1e-4)


def test_in_bfloat16_a_fused_norm_differs_by_one_rounding(tiny):
    model, _ = tiny
    norm = copy.deepcopy(model.model.norm).to(torch.bfloat16)
    norm.weight.data.normal_(generator=torch.Generator().manual_seed(1))
    x = torch.randn(4, 7, norm.weight.shape[0], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    own = norm(x).float()
    fused_modules(norm)
    fused = norm(x).float()
    x64 = x.double()
    exact = norm.weight.double() * x64 * x64.square().mean(-1, keepdim=True).add(norm.variance_epsilon).rsqrt()
    assert (fused - exact).abs().max() <= (own - exact).abs().max() + 1e-6  # one rounding, not two
    torch.testing.assert_close(fused, own, rtol=2**-7, atol=2**-7)


class OnePlusRMSNorm(torch.nn.Module):
    """A Gemma-style norm: ``(1 + weight)``, the name and attributes of a Llama one."""

    def __init__(self, width: int):
        super().__init__()
        self.weight, self.variance_epsilon = torch.nn.Parameter(torch.zeros(width)), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)


def test_a_norm_that_computes_something_else_keeps_its_forward():
    model = torch.nn.Sequential(OnePlusRMSNorm(8))
    assert fused_modules(model) == 0 and type(model[0]) is OnePlusRMSNorm


def test_the_cuda_backend_fuses_the_norms_and_recomputes_only_the_mlp_where_it_must(tiny):
    """The norms are fused, not recomputing; the MLPs recompute as the backend's rule says (on a
    machine without a GPU there is no memory to weigh and recomputation is kept). The rule itself
    is checked against a GPU's memory given by hand."""
    model, _ = tiny
    policy = copy.deepcopy(model)
    chosen = CUDABackend(torch.float32)
    wanted = chosen.recomputes(model)
    assert wanted or torch.cuda.is_available()
    chosen.prepare(policy, trains=True)
    assert all(isinstance(m, FusedRMSNorm) and not isinstance(m, RecomputingRMSNorm) for m in norms(policy))
    assert all(isinstance(layer.mlp, RecomputingGatedMLP) is wanted for layer in policy.model.layers)
    assert recomputes(policy) is wanted
    assert any("fused rms_norm" in why for _, _, why in describe(policy, kinds=(FusedRMSNorm,)))
    # the LM head's softmax recomputed in backward, never kept (both ways: tests/test_forward_chunked.py)
    assert chosen.keep_softmax_mib == 0 < Backend.keep_softmax_mib

    config = model.config  # the rule: 3 x intermediate values per token and layer against an eighth of the memory
    kept = 3 * config.intermediate_size * config.num_hidden_layers * 4 * 1000  # float32, 1,000 tokens
    backend = CUDABackend(torch.float32, train_rows=1000)
    assert backend.recomputes_within(model, memory_bytes=8 * kept - 8)
    assert not backend.recomputes_within(model, memory_bytes=8 * kept + 8)
    frozen = copy.deepcopy(model)
    backend.prepare(frozen)  # a frozen model (the reference) never recomputes
    assert not recomputes(frozen) and all(isinstance(m, FusedRMSNorm) for m in norms(frozen))


@pytest.mark.parametrize("rows, gib, recomputes_there", [(8 * 322, 80, False), (64 * 322, 80, True)])
def test_the_rule_at_the_qwen_shape(rows, gib, recomputes_there):
    """At the Qwen2.5-1.5B shape (8,960-wide MLP, 28 layers, bfloat16) on an 80 GB GPU: a micro-batch
    of 8 rows of 322 tokens keeps its 5.5 GB, one of 64 rows recomputes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**small_shape(intermediate_size=8960, num_hidden_layers=28))
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    assert CUDABackend(torch.bfloat16, train_rows=rows).recomputes_within(model, gib * 2**30) is recomputes_there


def test_a_lora_policy_prepared_by_the_cuda_backend_decodes_and_trains_as_before(tiny):
    """Trained adapters on the tiny model: the CUDA backend's preparation (fused norms and rotation,
    LoRA's lean layers) decodes on its merged copies the greedy rollouts of the plain peft model,
    static cache and growing, and its training forward gives the same log-probs and gradients."""
    from conftest import chat_prompt_ids, trained_lora
    from test_prompt_sharing import grouped_batch, run

    from ngrpo_lightning.explorers import TemperatureExplorer
    from ngrpo_lightning.rollout import HFEngine

    torch.manual_seed(0)
    plain = trained_lora()
    prepared = copy.deepcopy(plain)
    backend = CUDABackend(torch.float32)
    backend.prepare(prepared, trains=True)
    assert all(
        isinstance(a, FusedRotaryAttention)
        for a in prepared.base_model.model.model.layers[0].modules()
        if type(a).__name__.endswith("Attention")
    )
    tok = tiny[1]
    prompts = chat_prompt_ids(tok, ["What is 7 + 5?", "Name a prime number larger than ten."])
    runs = [
        HFEngine(
            m,
            tok,
            max_new_tokens=10,
            seed=0,
            static_cache=static,
            graphs="rerun" if static else False,
            backend=backend if m is prepared else None,
        ).generate(prompts, TemperatureExplorer(temperature=0.0), n=2)
        for m, static in ((plain, False), (prepared, False), (prepared, True))
    ]
    for r in runs[1:]:
        assert torch.equal(r.response_ids, runs[0].response_ids)
        torch.testing.assert_close(r.rollout_logprobs, runs[0].rollout_logprobs, rtol=1e-4, atol=1e-4)
    batch = grouped_batch(tiny[0].config.vocab_size)
    (ref_logp, _, ref_grads), (logp, _, grads) = run(plain, batch, False), run(prepared, batch, False)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=2e-5 * ref_logp.abs().max().item())
    assert grads.keys() == ref_grads.keys() and any("lora_B" in n for n in grads)
    for name, ref in ref_grads.items():  # float32 rounding: 2e-5 of the largest in 8 draws of B, for lora_A
        torch.testing.assert_close(grads[name], ref, rtol=0, atol=1e-4 * ref.abs().max().item(), msg=name)


@pytest.mark.parametrize(
    "share, checkpointed",  # a checkpointed policy runs each row's prompt (LogprobPasses._shares_prompts)
    [(False, False), (True, False), (False, True)],
    ids=["each-prompt", "shared-prompts", "checkpointed"],
)
def test_the_training_forward_of_a_fused_model_is_the_plain_model_s(share, checkpointed):
    """The log-prob pass as training runs it (records with noise, a group's prompt run once or per
    row, gradient checkpointing): the fused model's log-probs, entropies and gradients are the plain
    model's, in float32, its q|k|v and gate|up joined and multiplied as one product each way."""
    from test_forward_chunked import small_llama
    from test_prompt_sharing import grouped_batch, run

    from ngrpo_lightning.backends.fused import join_projections

    plain = small_llama()
    fused = copy.deepcopy(plain)
    layers = len(fused.model.layers)
    assert fused_modules(fused) == 4 * layers + 1  # norms, attentions, decoder layers
    assert fused_mlps(fused) == layers and join_projections(fused) == 2 * layers
    if checkpointed:
        for model in (plain, fused):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = grouped_batch(512)
    (ref_logp, ref_ent, ref_grads), (logp, ent, grads) = run(plain, batch, share), run(fused, batch, share)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=2e-5 * ref_logp.abs().max().item())
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=2e-5 * ref_ent.abs().max().item())
    assert grads.keys() == ref_grads.keys() and grads
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=0, atol=2e-5 * ref.abs().max().item(), msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the fused kernel is CUDA's")
def test_a_fused_norm_is_one_kernel_forward_on_a_gpu(tiny):
    from torch.profiler import ProfilerActivity, profile

    def kernels(norm, x) -> tuple[int, int]:
        """CUDA kernels of the norm's forward, and of forward and backward."""
        norm(x).sum().backward()  # warm
        counts = []
        for backward in (False, True):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                y = norm(x)
                if backward:
                    y.backward(torch.ones_like(y))
                torch.cuda.synchronize()
            counts.append(sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events()))
        return tuple(counts)

    own = copy.deepcopy(tiny[0].model.norm).to("cuda", torch.bfloat16)
    fused = copy.deepcopy(own)
    assert fused_modules(fused) == 1
    x = torch.randn(32, 5, own.weight.shape[0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    (own_forward, own_both), (fused_forward, fused_both) = kernels(own, x), kernels(fused, x)
    assert fused_forward == 1 and own_forward >= 6, (fused_forward, own_forward)
    assert fused_both <= own_both // 2, (fused_both, own_both)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: kernels are counted there")
def test_fused_rotation_launches_six_kernels_fewer_per_layer_on_a_gpu(tiny):
    from torch.profiler import ProfilerActivity, profile

    own = copy.deepcopy(tiny[0].model.layers[0].self_attn).to("cuda", torch.bfloat16).eval()
    fused = copy.deepcopy(own)
    assert fused_modules(fused) == 1
    x = torch.randn(32, 1, own.q_proj.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(32, 1, own.head_dim // 2, device="cuda")
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))

    def kernels(attention) -> int:
        attention(x, position_embeddings=(cos, sin))  # warm
        with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
            attention(x, position_embeddings=(cos, sin))
            torch.cuda.synchronize()
        return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())

    # transformers' rotation: 10 kernels; this one: 4, and 2 for sin' (once per forward, here per call)
    assert kernels(fused) <= kernels(own) - 4, (kernels(fused), kernels(own))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: kernels are counted there")
def test_a_rollout_s_rotation_of_its_strided_queries_and_keys_is_three_kernels_on_a_gpu():
    """In a rollout the queries and keys are a strided slice of the one q, k, v product: the
    rotation reads it as it is (a product, a swap of halves, a fused multiply-add), where CUDA's
    ``roll`` copied it first; ``sin'`` is kept from the first call."""
    from torch.profiler import ProfilerActivity, profile

    from ngrpo_lightning.backends.fused import rotated

    qkv = torch.randn(32, 1, 15, 64, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(32, 1, 32, device="cuda")
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    both = qkv[..., :12, :]
    expected = both * cos.unsqueeze(-2) + torch.cat([-both[..., 32:], both[..., :32]], -1) * sin.unsqueeze(-2)
    torch.testing.assert_close(rotated(both, cos, sin), expected)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rotated(both, cos, sin)
        torch.cuda.synchronize()
    assert sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events()) == 3


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
    CUDABackend(torch.float32).prepare(model.eval())
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

    from ngrpo_lightning.backends.joint_products import rows_of_one_tensor
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
    backend = CUDABackend(torch.float32)
    backend.on_device(backend.prepare(model, trains=True))
    mlp = mlps(model)[0]
    with torch.no_grad():
        mlp.up_proj.weight.data = mlp.up_proj.weight.detach().clone()  # as a move to another device would
    with packed_for_pass(model, rows=2, decoding=True):
        assert mlp._joint is None and mlps(model)[1]._joint is not None


def test_a_fit_joins_the_policy_s_projections_once_lightning_has_placed_it(tiny):
    """``RLModule.on_fit_start`` hands the policy, on its device by then, to the backend's
    ``on_device``: with the CUDA backend's modules (here on the CPU, decoding eagerly) the trained
    policy's gate and up weights are joined, and its training steps go on from there."""
    from conftest import ScriptedReward, tiny_rl, tiny_trainer

    from ngrpo_lightning.backends.cuda import CUDAEagerBackend
    from ngrpo_lightning.backends.joint_products import rows_of_one_tensor

    backend = CUDAEagerBackend(torch.float32)
    module, datamodule = tiny_rl(tiny, ScriptedReward([1, 0]), backend=backend)
    backend.prepare(module.policy, trains=True)
    mlp = mlps(module.policy)[0]
    assert isinstance(mlp, FusedGatedMLP) and rows_of_one_tensor([mlp.gate_proj.weight, mlp.up_proj.weight]) is None
    before = mlp.up_proj.weight.detach().clone()
    tiny_trainer(2).fit(module, datamodule=datamodule)
    assert rows_of_one_tensor([mlp.gate_proj.weight, mlp.up_proj.weight]) is not None
    assert not torch.equal(mlp.up_proj.weight, before)  # trained, in its joined rows


def test_a_joint_product_s_gradients_go_to_each_block_s_own_parameter():
    """``JointLinear``: one product over weights (and biases) that are row blocks of one tensor,
    each block's gradient its parameter's: checked against finite differences in float64, with a
    frozen block given none, and its value ``F.linear`` on the blocks concatenated."""
    from ngrpo_lightning.backends.joint_products import JointLinear

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
    from ngrpo_lightning.backends.joint_products import JointLoraProduct

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

    from ngrpo_lightning.backends.joint_products import rows_of_one_tensor
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
