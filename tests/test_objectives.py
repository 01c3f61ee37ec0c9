"""GRPO loss, KL estimators, aggregation and advantages against hand computations."""

import math

import pytest
import torch

from ngrpo_lightning.objectives import GRPO, aggregate, group_advantages, grpo_loss, kl_penalty, zero_variance_groups


def test_grpo_loss_matches_hand_computation_and_gradient():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0], [-0.1, -2.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, m = grpo_loss(logp, old, None, adv, mask, clip_low=0.2, clip_high=0.2)
    # by hand: ratios e^0.5=1.6487 (A=+1, clipped at 1.2 -> -1.2, no grad), e^0=1 (-1.0),
    # e^-0.4=0.6703 (A=-2: max(1.3406, 2*0.8=1.6) = 1.6 clipped, no grad); token 4 masked.
    expected = (-1.2 - 1.0 + 1.6) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    # only the unclipped token (row 0, col 1) has gradient: d/dlogp (-A r)/3 = -1/3
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -1 / 3], [0.0, 0.0]]), atol=1e-6)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 3)
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.5), rel=1e-6)


def test_dual_clip_caps_negative_advantage_loss():
    logp = torch.tensor([[2.0]])
    old = torch.tensor([[0.0]])  # ratio e^2 = 7.39 with A = -1: loss 7.39 unclipped
    loss, _ = grpo_loss(logp, old, None, torch.tensor([-1.0]), torch.ones(1, 1), dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)


def test_ratio_one_no_kl_gives_plain_policy_gradient():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7, requires_grad=True)
    tokens = torch.randint(0, 7, (3, 5))
    mask = torch.ones(3, 5)
    adv = torch.tensor([0.5, -1.0, 2.0])
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    loss, _ = GRPO(kl_coef=0.0)(logp, logp.detach(), None, adv, mask)
    (g_grpo,) = torch.autograd.grad(loss, logits, retain_graph=True)
    pg = -(adv[:, None] * logp).sum() / mask.sum()
    (g_pg,) = torch.autograd.grad(pg, logits)
    assert torch.allclose(g_grpo, g_pg, atol=1e-6)


def test_kl_estimators_against_analytic_kl():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6), 0)
    q = torch.softmax(torch.randn(6), 0)
    analytic = (p * (p / q).log()).sum()
    y = torch.multinomial(p, 400_000, replacement=True)
    logp, logq = p.log()[y], q.log()[y]
    k1 = kl_penalty(logp, logq, "k1").mean()
    k2 = kl_penalty(logp, logq, "k2").mean()
    k3 = kl_penalty(logp, logq, "k3").mean()
    assert k1.item() == pytest.approx(analytic.item(), rel=0.03)
    assert k3.item() == pytest.approx(analytic.item(), rel=0.03)
    assert (kl_penalty(logp, logq, "k3") >= 0).all()
    # k2 is second-order: close for nearby distributions, biased for distant ones
    q_near = torch.softmax(p.log() + 0.05 * torch.randn(6), 0)
    near = (p * (p / q_near).log()).sum()
    assert kl_penalty(logp, q_near.log()[y], "k2").mean().item() == pytest.approx(near.item(), rel=0.1)


def test_aggregation_modes_weigh_sequences_as_defined():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(8 / 5)  # the long sequence dominates
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((1 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx((4 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum-norm").item() == pytest.approx(8 / (2 * 4))
    assert aggregate(values, mask, "seq-mean-token-sum-norm", norm_length=8).item() == pytest.approx(8 / 16)


def test_group_advantages_estimators():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(r, 4, "grpo")
    g = r[:4]
    assert torch.allclose(a[:4], (g - g.mean()) / (g.std() + 1e-6))
    assert torch.all(a[4:] == 0)  # all-equal group: no signal
    assert torch.allclose(group_advantages(r, 4, "dr_grpo")[:4], g - g.mean())
    assert torch.allclose(group_advantages(r, 4, "batch_std")[:4], (g - g.mean()) / (r.std() + 1e-6))
    assert zero_variance_groups(r, 4).tolist() == [False, True]


@pytest.mark.parametrize(
    "kwargs, key",
    [({"loss_agg": "mean"}, "objective.loss_agg"), ({"kl_estimator": "k4"}, "objective.kl_estimator"),
     ({"clip_low": -0.1}, "objective.clip_low"), ({"dual_clip": 0.5}, "objective.dual_clip")],
)
def test_bad_objective_config_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        GRPO(**kwargs)


def test_unknown_advantage_estimator_lists_allowed():
    with pytest.raises(ValueError, match="allowed.*grpo"):
        group_advantages(torch.zeros(4), 2, "ppo")


def test_kl_needs_reference_logprobs():
    with pytest.raises(ValueError, match="reference"):
        GRPO(kl_coef=0.1)(torch.zeros(1, 1), torch.zeros(1, 1), None, torch.zeros(1), torch.ones(1, 1))
