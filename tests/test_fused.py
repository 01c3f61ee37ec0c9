"""The CUDA backend's fused norms and its choice of recomputation, checked on the CPU (where
``torch.nn.functional.rms_norm`` runs as its composite of the same steps); the kernel count of the
fused norm on a GPU is checked by the GPU tests (``-k on_a_gpu``)."""

from __future__ import annotations

import copy

import pytest
import torch

from ngrpo_lightning.backends.base import Backend
from ngrpo_lightning.backends.cuda import CUDABackend
from ngrpo_lightning.backends.fused import FusedRMSNorm, fused_modules
from ngrpo_lightning.backends.recompute import RecomputingGatedMLP, RecomputingRMSNorm, recomputes
from ngrpo_lightning.backends.swap import describe, original_class


def norms(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def test_fused_norms_give_transformers_outputs_and_gradients(tiny):
    model, _ = tiny
    own, fused = copy.deepcopy(model), copy.deepcopy(model)
    assert fused_modules(fused) == len(norms(fused)) == 2 * len(fused.model.layers) + 1
    pairs = zip(norms(fused), norms(own), strict=True)
    assert all(isinstance(m, FusedRMSNorm) and original_class(m) is type(n) for m, n in pairs)
    ids = torch.randint(0, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    a, b = own(input_ids=ids).logits, fused(input_ids=ids).logits
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    a.square().mean().backward()
    b.square().mean().backward()
    for (name, p), q in zip(own.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert fused_modules(fused) == 0  # idempotent


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

    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=16,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    assert CUDABackend(torch.bfloat16, train_rows=rows).recomputes_within(model, gib * 2**30) is recomputes_there


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
