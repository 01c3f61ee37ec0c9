"""When a run joins the CUDA backend's projections (``Backend.on_device``, from ``RLModule``'s
``on_fit_start`` and ``on_validation_start``): once Lightning has placed the models, for the policy
and for the frozen KL reference, checked on the CPU with the CUDA backend decoding eagerly."""

from __future__ import annotations

import copy

import torch
from test_fused import attentions, mlps
from test_joined import Products

from ngrpo_lightning.backends.fused import FusedGatedMLP

JOINS = ["fewer_kernels_per_layer", "joined_reference"]  # off by default until measured on a GPU


def test_a_fit_joins_the_policy_s_projections_once_lightning_has_placed_it(tiny):
    """``RLModule.on_fit_start`` hands the policy, on its device by then, to the backend's
    ``on_device``: with the CUDA backend's modules (here on the CPU, decoding eagerly) the trained
    policy's gate and up weights are joined, and its training steps go on from there."""
    from conftest import ScriptedReward, tiny_rl, tiny_trainer

    from ngrpo_lightning.backends.cuda import CUDABackend
    from ngrpo_lightning.backends.joined import rows_of_one_tensor

    backend = CUDABackend(torch.float32, disable=["decode_graphs"], enable=JOINS)
    module, datamodule = tiny_rl(tiny, ScriptedReward([1, 0]), backend=backend)
    backend.prepare(module.policy, trains=True)
    mlp = mlps(module.policy)[0]
    assert isinstance(mlp, FusedGatedMLP) and rows_of_one_tensor([mlp.gate_proj.weight, mlp.up_proj.weight]) is None
    before = mlp.up_proj.weight.detach().clone()
    tiny_trainer(2).fit(module, datamodule=datamodule)
    assert rows_of_one_tensor([mlp.gate_proj.weight, mlp.up_proj.weight]) is not None
    assert not torch.equal(mlp.up_proj.weight, before)  # trained, in its joined rows


def test_a_fit_joins_the_frozen_reference_too_and_its_log_probs_stay_those_of_the_layers_apart(tiny):
    """The KL reference (a frozen copy, in memory) is joined once on its device as the policy is, so
    its log-prob passes make one product per group; its outputs are those of the same weights with
    each projection multiplied apart."""
    from conftest import ScriptedReward, tiny_rl, tiny_trainer

    from ngrpo_lightning.backends.cuda import CUDABackend
    from ngrpo_lightning.backends.joined import rows_of_one_tensor
    from ngrpo_lightning.objectives import GRPO

    backend = CUDABackend(torch.float32, disable=["decode_graphs"], enable=JOINS)
    module, datamodule = tiny_rl(
        tiny, ScriptedReward([1, 0]), objective=GRPO(kl_coef=0.1), backend=backend, reference=copy.deepcopy(tiny[0])
    )
    apart = copy.deepcopy(tiny[0]).eval()
    for model in (module.reference, apart):
        backend.prepare(model)
    backend.prepare(module.policy, trains=True)
    reference_mlp = mlps(module.reference)[0]
    assert rows_of_one_tensor([reference_mlp.gate_proj.weight, reference_mlp.up_proj.weight]) is None
    tiny_trainer(1).fit(module, datamodule=datamodule)
    for a, m in zip(attentions(module.reference), mlps(module.reference), strict=True):
        assert rows_of_one_tensor([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]) is not None
        assert rows_of_one_tensor([m.gate_proj.weight, m.up_proj.weight]) is not None
    ids = torch.randint(0, tiny[0].config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), Products() as joined:
        logits = module.reference(input_ids=ids).logits
    with torch.no_grad(), Products() as separate:
        expected = apart(input_ids=ids).logits
    layers = len(attentions(apart))
    assert separate.count - joined.count == 3 * layers  # q, k, v as one product and gate, up as one
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_a_validation_on_its_own_joins_them_too(tiny):
    """``trainer.validate`` (the train command's validation before the fit) rolls out as well: the
    policy's projections are joined before its first validation rollout."""
    from conftest import ScriptedReward, tiny_rl, tiny_trainer

    from ngrpo_lightning.backends.cuda import CUDABackend
    from ngrpo_lightning.backends.joined import rows_of_one_tensor
    from ngrpo_lightning.data import reasoning_gym_problems
    from ngrpo_lightning.rollout import RolloutDataModule

    backend = CUDABackend(torch.float32, disable=["decode_graphs"], enable=JOINS)
    module, _ = tiny_rl(tiny, ScriptedReward([1, 0]), backend=backend)
    backend.prepare(module.policy, trains=True)
    problems = reasoning_gym_problems(["chain_sum"], 2, seed=0)
    datamodule = RolloutDataModule(module.tokenizer, problems, problems, prompts_per_step=2, group_size=2, seed=0)
    mlp = mlps(module.policy)[0]
    assert rows_of_one_tensor([mlp.gate_proj.weight, mlp.up_proj.weight]) is None
    tiny_trainer(0, limit_val_batches=1).validate(module, datamodule=datamodule, verbose=False)
    assert rows_of_one_tensor([mlp.gate_proj.weight, mlp.up_proj.weight]) is not None
