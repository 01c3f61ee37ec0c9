"""RLModule updates: micro-batching does not change the gradient."""

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
