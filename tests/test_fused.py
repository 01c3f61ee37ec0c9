"""The CUDA backend's fused norms and rotary embeddings and its choice of recomputation, checked on
the CPU (where ``torch.nn.functional.rms_norm`` runs as its composite of the same steps); the
kernel count of the fused norm on a GPU is checked by the GPU tests (``-k on_a_gpu``)."""

from __future__ import annotations

import copy

import pytest
import torch

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
