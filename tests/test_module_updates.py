"""RLModule updates: micro-batching does not change the gradient."""

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import fake_step

from ngrpo_lightning.module import OptimConfig, RLModule
from ngrpo_lightning.objectives import GRPO, GSPO


@pytest.mark.parametrize("objective", [
    GRPO(kl_coef=0.0, loss_agg="token-mean"), GRPO(kl_coef=0.0, loss_agg="seq-mean-token-mean"),
    GRPO(kl_coef=0.0, loss_agg="seq-mean-token-sum-norm", norm_length=7), GSPO(clip_low=0.2, clip_high=0.2),
], ids=lambda o: f"{o.registered_name}-{o.loss_agg}")
def test_micro_batches_give_the_whole_batch_gradient(objective):
    torch.manual_seed(0)
    step = fake_step(list("aabbcc"), [1, 0, 1, 1, 0, 1], lengths=[1, 4, 2, 3, 4, 4])  # 10 tokens in rows 0-3, 8 in rows 4-5
    mask = step.batch.response_mask
    logp = (-torch.rand(mask.shape) * mask).requires_grad_()
    old, adv = logp.detach() + 0.05 * torch.randn(mask.shape), torch.randn(6)
    (whole,) = torch.autograd.grad(objective(logp, old, None, adv, mask)[0], logp)
    module = SimpleNamespace(optim=OptimConfig(micro_batch_size=4), objective=objective)
    summed = torch.zeros_like(logp)
    for rows, weight in RLModule._micro_batches(module, step.batch):
        loss, _ = objective(logp[rows], old[rows], None, adv[rows], mask[rows])
        summed += torch.autograd.grad(loss * weight, logp)[0]
    assert torch.allclose(summed, whole, atol=1e-6)


def test_truncated_importance_sampling_weights_the_policy_gradient(tiny):
    """train.tis_cap: tokens whose rollout log-prob is below the trainer's get weight
    min(p_train / p_rollout, cap); with agreeing log-probs the update is unchanged."""
    from conftest import ScriptedReward, fake_step, tiny_rl

    step = fake_step(["a", "a", "b", "b"], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    module, _ = tiny_rl(tiny, ScriptedReward([1]), tis_cap=2.0)
    step.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    step.old_logp = step.batch.rollout_logprobs.clone()
    advantages, stats = module._tis_advantages(step)
    mask = step.batch.response_mask.bool()
    assert torch.allclose(advantages[mask], (step.advantages[:, None] * mask)[mask])  # no mismatch: weight 1
    assert stats["tis_weight_mean"] == pytest.approx(1.0)
    step.batch.rollout_logprobs[0] -= 0.1  # row 0: p_train / p_rollout = e^0.1
    step.batch.rollout_logprobs[2] -= 5.0  # row 2: e^5, capped at 2
    advantages, stats = module._tis_advantages(step)
    assert torch.allclose(advantages[0][mask[0]], torch.full((3,), math.exp(0.1)))
    assert torch.allclose(advantages[2][mask[2]], torch.full((3,), 2.0))
    assert stats["tis_clipped_frac"] == pytest.approx(0.25)


def test_tis_cap_is_checked(tiny):
    from conftest import ScriptedReward, tiny_rl
    from ngrpo_lightning.objectives import GSPO

    with pytest.raises(ValueError, match=r"train.tis_cap=0 must be a number > 0"):
        tiny_rl(tiny, ScriptedReward([1]), tis_cap=0)
    with pytest.raises(ValueError, match=r"train.tis_cap needs an objective that takes per-token advantages; GSPO"):
        tiny_rl(tiny, ScriptedReward([1]), objective=GSPO(), tis_cap=2.0)
