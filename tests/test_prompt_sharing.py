"""Prompts shared by a group (``response_logprobs(..., share_prompts=True)``): each distinct
prompt runs once, its keys and values are repeated for its samples, and the responses attend
to them. Values and gradients must equal the repeated-prompt forward's (every parameter, mixed
steps with noise included), whatever the rows' order; nothing is shared when no prompt repeats.

Tolerances, relative to each tensor's largest entry. The log-probs come out equal; gradients
differ in rounding because the attention kernels run on other shapes and sum the samples'
contributions to a prompt in another order. In float64 that noise is as large as the difference
between two attention implementations on the same forward (sdpa vs eager, measured: 5e-8), hence
1e-7; in float32 2e-5, as in test_forward_chunked.py.
"""

import copy

import pytest
import torch
from test_forward_chunked import small_llama

from ngrpo_lightning.rollout import InputRecords, RolloutBatch
from ngrpo_lightning.training.forward import response_logprobs, shared_prompts
from ngrpo_lightning.training.logprob_passes import layer_params, shared_prompt_tokens

GROUPS, G, P, L = 2, 3, 6, 9


def grouped_batch(vocab: int, order=None, seed: int = 0) -> RolloutBatch:
    """2 prompts x 3 samples (the second prompt left padded), responses of different lengths
    (one empty), records with noise in rows of both groups; ``order`` permutes the rows."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (GROUPS, P), generator=g)
    prompt_mask = torch.ones(GROUPS, P, dtype=torch.long)
    prompt_mask[1, :2] = 0
    prompt_ids = (prompts * prompt_mask).repeat_interleave(G, 0)
    prompt_mask = prompt_mask.repeat_interleave(G, 0)
    n = GROUPS * G
    response_ids = torch.randint(0, vocab, (n, L), generator=g)
    lengths = torch.tensor([L, 4, 1, L, 0, 6])
    response_mask = (torch.arange(L)[None] < lengths[:, None]).long()
    records = InputRecords(
        row=torch.tensor([0, 1, 3, 5]),
        pos=torch.tensor([0, 2, 5, 3]),
        ids=torch.randint(0, vocab, (4, 3), generator=g),
        weights=torch.rand(4, 3, generator=g).softmax(-1),
        noise_seed=torch.tensor([7, -1, 8, -1]),
        noise_scale=torch.tensor([0.3, 0.0, 0.2, 0.0]),
    )
    batch = RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(n, L), records, group_size=G)
    return batch if order is None else batch.select(torch.tensor(order))


def run(model, batch, share: bool):
    model.zero_grad(set_to_none=True)
    logp, entropy = response_logprobs(model, batch, 0.7, with_entropy=True, share_prompts=share)
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1), dtype=logp.dtype)
    (logp * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy, grads


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-7), (torch.float32, 2e-5)])
@pytest.mark.parametrize("order", [None, [4, 0, 5, 2, 1, 3]], ids=["grouped", "shuffled"])
def test_shared_prompts_give_the_same_values_and_gradients(dtype, tol, order):
    model = small_llama().to(dtype)
    batch = grouped_batch(512, order)
    assert shared_prompts(batch) is not None
    ref_logp, ref_ent, ref_grads = run(model, batch, share=False)
    logp, ent, grads = run(copy.deepcopy(model), batch, share=True)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=tol * ref_logp.abs().max().item())
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=tol * ref_ent.abs().max().item())
    assert grads.keys() == ref_grads.keys() and grads
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=0, atol=tol * ref.abs().max().item(), msg=name)


def test_groups_are_found_by_prompt_not_by_position():
    batch = grouped_batch(512, [4, 0, 5, 2, 1, 3])
    first, inverse = shared_prompts(batch)
    assert len(first) == GROUPS
    assert torch.equal(batch.prompt_ids[first][inverse], batch.prompt_ids)  # every row gets its own prompt
    groups = torch.tensor([1, 0, 1, 0, 0, 1])  # the rows' original groups
    assert torch.equal(inverse[:, None] == inverse[None], groups[:, None] == groups[None])


def test_nothing_is_shared_when_every_prompt_differs():
    batch = grouped_batch(512).select(torch.tensor([0, 3]))
    assert shared_prompts(batch) is None


def test_the_per_row_prompt_keys_are_recomputed_not_kept():
    """Under recompute.recomputing, attention's per-row copy of the prompt's keys and values is
    rebuilt in backward from the one-per-prompt pass: the same bits, no such copy kept."""
    from ngrpo_lightning.backends import attention, recompute

    model = small_llama()
    model.set_attn_implementation(attention.register())  # the default: grouped keys and values read as they are
    batch = grouped_batch(512, [4, 0, 5, 2, 1, 3])
    c = model.config
    per_row = len(batch) * c.num_key_value_heads * (P + L) * (c.hidden_size // c.num_attention_heads) * 4

    def copies(kept: dict[int, int]) -> int:  # kept storages of [rows, kv heads, P + L, head dim]
        return sum(n == per_row for n in kept.values())

    plain: dict[int, int] = {}

    def tally(t):
        plain[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(tally, lambda t: t):
        logp0, _, grads0 = run(model, batch, share=True)
    kept: dict[int, int] = {}
    with recompute.tallying_kept(kept):
        logp1, _, grads1 = run(model, batch, share=True)
    assert copies(plain) == 2 * c.num_hidden_layers  # keys and values of every layer, before
    assert copies(kept) == 0
    assert torch.equal(logp0, logp1)
    assert grads0.keys() == grads1.keys()
    for name, ref in grads0.items():
        assert torch.equal(grads1[name], ref), name


def test_the_shared_prompt_cache_is_made_of_its_own_layers():
    """The responses' pass reads the distinct prompts' keys and values through cache layers of
    their own class (``SharedPrefixLayer``), not through a patched ``update``: each row gets its
    prompt's rows followed by its new keys, and nothing is stored."""
    from transformers import DynamicCache

    from ngrpo_lightning.training.forward import SharedPrefixLayer, _read_only_prefix

    cache = DynamicCache()
    keys, values = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    cache.update(keys, values, 0)
    rows = torch.tensor([0, 0, 1])
    stored = cache.layers[0].keys, cache.layers[0].values
    cache = _read_only_prefix(cache, rows)
    layer = cache.layers[0]
    assert type(layer) is SharedPrefixLayer and "update" not in vars(layer)
    new_k, new_v = torch.randn(3, 3, 2, 8), torch.randn(3, 3, 2, 8)
    k, v = cache.update(new_k, new_v, 0)
    assert torch.equal(k, torch.cat([keys[rows], new_k], dim=-2))
    assert torch.equal(v, torch.cat([values[rows], new_v], dim=-2))
    assert layer.keys is stored[0] and layer.values is stored[1]  # nothing stored


@pytest.mark.parametrize("adapters", [False, True], ids=["plain", "LoRA"])
def test_checkpointed_layers_are_read_from_the_layers_as_transformers_reports_them(adapters):
    """Prompt sharing is off under gradient checkpointing: ``layers_checkpointed`` reads it from the
    decoder layers, with transformers' answer (which walks every module) before and after."""
    from conftest import trained_lora

    from ngrpo_lightning.models.loading import load_policy
    from ngrpo_lightning.training.logprob_passes import layers_checkpointed

    model = trained_lora() if adapters else load_policy("tiny")[0]
    assert layers_checkpointed(model) is False and not model.is_gradient_checkpointing
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert layers_checkpointed(model) is True and model.is_gradient_checkpointing
    model.gradient_checkpointing_disable()
    assert layers_checkpointed(model) is False and not model.is_gradient_checkpointing


def test_a_pass_leaves_out_every_row_but_one_per_group_of_its_prompt_width():
    batch = grouped_batch(100)  # 6 rows in groups of 3, prompts 6 wide
    assert shared_prompt_tokens(batch) == (6 - 2) * P
    assert shared_prompt_tokens(batch.select(torch.tensor([0, 1]))) == 1 * P  # a micro-batch of one group
    assert shared_prompt_tokens(batch.select(torch.tensor([4]))) == 0


def meta_layer_params(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: nothing allocated
        return layer_params(AutoModelForCausalLM.from_config(config))


def test_the_cuda_backend_shares_a_prompt_only_where_its_arithmetic_outweighs_a_second_passs_launches():
    """On a GPU a small model's pass waits on kernel launches, and sharing launches each layer's
    kernels twice. 4 prompts x 8 samples with the built-in task's 66-token prompts: the packaged
    model's pass runs each row's prompt; Qwen2.5-1.5B's shapes share in a pass of 32 rows but not in
    a micro-batch of one group; Qwen2.5-7B's share in both. A CPU's pass is its arithmetic: it
    always shares."""
    from transformers import AutoConfig, Qwen2Config

    from ngrpo_lightning.backends import CPUBackend, CUDABackend
    from ngrpo_lightning.models.loading import resolve_model_path

    qwen = dict(num_hidden_layers=1, vocab_size=1000, head_dim=128)
    params = {
        "packaged": meta_layer_params(AutoConfig.from_pretrained(resolve_model_path("smollm2-135m-instruct"))),
        "1.5b": meta_layer_params(
            Qwen2Config(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2, **qwen)
        ),
        "7b": meta_layer_params(
            Qwen2Config(
                hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4, **qwen
            )
        ),
    }
    assert 3.5e6 < params["packaged"] < 3.6e6 and 46e6 < params["1.5b"] < 48e6 and 230e6 < params["7b"] < 236e6
    cuda, cpu = CUDABackend(torch.bfloat16), CPUBackend(torch.float32)
    whole, one_group = (32 - 4) * 66, (8 - 1) * 66
    decided = {
        (name, rows): cuda.shares_prompts(saved, p)
        for name, p in params.items()
        for rows, saved in ((32, whole), (8, one_group))
    }
    assert decided == {
        ("packaged", 32): False, ("packaged", 8): False,
        ("1.5b", 32): True, ("1.5b", 8): False,
        ("7b", 32): True, ("7b", 8): True,
    }  # fmt: skip
    assert all(cpu.shares_prompts(saved, params["packaged"]) for saved in (whole, one_group, 1))
    cuda.share_prompts = False  # a subclass that never shares
    assert not cuda.shares_prompts(whole, params["7b"])


def test_a_log_prob_pass_shares_prompts_as_its_backend_decides(tiny):
    """The same values either way; the CUDA backend's pass of the tiny model runs its decoder once
    (each row its prompt), the CPU's twice (the prompts, then the responses)."""
    from conftest import ScriptedReward, tiny_rl

    from ngrpo_lightning.backends import CPUBackend, CUDABackend

    batch = grouped_batch(tiny[0].config.vocab_size)
    out = {}
    for backend in (CPUBackend(torch.float32, packing="off"), CUDABackend(torch.float32)):
        module, _ = tiny_rl(tiny, ScriptedReward([1]), backend=backend)
        calls = []
        hook = module.policy.model.register_forward_hook(lambda *args, calls=calls: calls.append(1))
        with torch.no_grad():
            out[backend.device_type] = module._logprobs(module.policy, batch, 0.7)[0]
        hook.remove()
        assert len(calls) == (2 if backend.device_type == "cpu" else 1)
    assert (out["cpu"] - out["cuda"]).abs().max() < 1e-5
