"""GRPO loss, KL estimators, aggregation and advantages against hand computations."""

import math

import pytest
import torch

from ngrpo_lightning.objectives import (
    GRPO,
    GSPO,
    OBJECTIVES,
    aggregate,
    group_advantages,
    grpo_loss,
    gspo_loss,
    kl_penalty,
    sequence_importance_weight,
    zero_variance_groups,
)


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
    k2 = kl_penalty(logp, logq, "k2").mean()  # 0.5 E[(log p/q)^2]: a second-order approximation
    k3 = kl_penalty(logp, logq, "k3").mean()
    assert k1.item() == pytest.approx(analytic.item(), rel=0.03)
    assert k3.item() == pytest.approx(analytic.item(), rel=0.03)
    assert k2.item() == pytest.approx(analytic.item(), rel=0.5) and k2.item() > 0
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


def test_calibrated_advantage_adds_a_virtual_max_reward_sample():
    """NGRPO: statistics over G rewards + one reward 1.0, re-derived by hand for G = 8."""
    wrong = torch.zeros(8)  # mean' = 1/9, std' = sqrt((8 (1/9)^2 + (8/9)^2) / 8) = 1/3
    assert torch.allclose(group_advantages(wrong, 8, "calibrated"), torch.full((8,), -1 / 3), atol=1e-5)
    assert torch.all(group_advantages(torch.ones(8), 8, "calibrated") == 0)  # all correct: no signal
    mixed = torch.tensor([1.0, 0.0, 0.0, 1.0])
    values = [1.0, 0.0, 0.0, 1.0, 1.0]
    mean = sum(values) / 5
    std = (sum((v - mean) ** 2 for v in values) / 4) ** 0.5
    expected = torch.tensor([(v - mean) / (std + 1e-6) for v in mixed.tolist()])
    assert torch.allclose(group_advantages(mixed, 4, "calibrated"), expected, atol=1e-6)
    grpo = group_advantages(mixed, 4, "grpo")  # positives shrunk, negatives enlarged relative to GRPO
    assert (expected[0] < grpo[0]) and (expected[1] < grpo[1])


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"loss_agg": "mean"}, "objective.loss_agg"),
        ({"kl_estimator": "k4"}, "objective.kl_estimator"),
        ({"clip_low": -0.1}, "objective.clip_low"),
        ({"dual_clip": 0.5}, "objective.dual_clip"),
    ],
)
def test_bad_objective_config_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        GRPO(**kwargs)


def test_unknown_advantage_estimator_lists_allowed():
    with pytest.raises(ValueError, match="allowed.*grpo"):
        group_advantages(torch.zeros(4), 2, "ppo")


def test_an_estimator_by_its_path_is_run_and_its_shape_checked(tmp_path, monkeypatch, capsys):
    """advantage=<module>.<function> (as explorer._target_): no registry, no package of one's own.
    One that returns a value per group, not per reward, is refused before any model loads."""
    from ngrpo_lightning.commands.cli import main

    (tmp_path / "my_adv.py").write_text(
        "def centered(r, eps):\n    return r - r.mean(-1, keepdim=True)\n\n"
        "def per_group(r, eps):\n    return r.mean(-1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    assert group_advantages(rewards, 3, "my_adv.centered").tolist() == pytest.approx(
        [2 / 3, -1 / 3, -1 / 3] + [-2 / 3, 1 / 3, 1 / 3]
    )
    with pytest.raises(ValueError, match=r"advantage=my_adv.per_group: the estimator returned shape \(2,\)"):
        group_advantages(rewards, 3, "my_adv.per_group")
    assert main(["train", "model=tiny", "advantage=my_adv.per_group", "logger=none", f"output_dir={tmp_path}"]) == 2
    assert "it must return one advantage per reward, [groups, G]" in capsys.readouterr().err


BAD_OBJECTIVES = """
import torch
from ngrpo_lightning.objectives import PolicyObjective, aggregate


class Typo(PolicyObjective):
    loss_agg = "tokenmean"

    def __call__(self, logp, old_logp, ref_logp, advantages, mask):
        return aggregate(-advantages[:, None] * logp, mask, "token-mean"), {}


class LossOnly(PolicyObjective):
    def __call__(self, logp, old_logp, ref_logp, advantages, mask):
        return aggregate(-advantages[:, None] * logp, mask, self.loss_agg)


class PerRow(PolicyObjective):
    def __call__(self, logp, old_logp, ref_logp, advantages, mask):
        return -(advantages[:, None] * logp).mean(-1), {}


class Detached(PolicyObjective):
    def __call__(self, logp, old_logp, ref_logp, advantages, mask):
        return aggregate(-advantages[:, None] * old_logp, mask, self.loss_agg), {}
"""


@pytest.mark.parametrize(
    "name, message",
    [
        ("Typo", "objective: Typo.loss_agg='tokenmean' is unknown: allowed ['token-mean'"),
        ("LossOnly", "objective: LossOnly returned a Tensor: an objective returns (loss, metrics)"),
        ("PerRow", "objective: PerRow's loss must be one number (a 0-d tensor; aggregate() reduces per-token"),
        ("Detached", "objective: Detached's loss has no gradient with respect to logp"),
    ],
)
def test_an_objective_is_run_once_before_anything_loads(tmp_path, monkeypatch, capsys, name, message):
    """A user's objective that returns something else failed inside the first update (a traceback
    from the loop); an unknown loss_agg weighed micro-batches as another mode, silently."""
    from ngrpo_lightning.commands.cli import main

    (tmp_path / "bad_objectives.py").write_text(BAD_OBJECTIVES)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["train", "model=tiny", f"objective._target_=bad_objectives.{name}", "logger=none", f"output_dir={tmp_path}"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_kl_needs_reference_logprobs():
    with pytest.raises(ValueError, match="reference"):
        GRPO(kl_coef=0.1)(torch.zeros(1, 1), torch.zeros(1, 1), None, torch.zeros(1), torch.ones(1, 1))


# ------------------------------------------------------------------ GRPO extras
def test_dual_clip_gradient_and_metric():
    logp = torch.tensor([[2.0, 0.1]], requires_grad=True)
    old = torch.zeros(1, 2)  # ratios e^2 (dual-clipped at 3) and e^0.1 = 1.105 (unclipped, A < 0)
    loss, m = grpo_loss(logp, old, None, torch.tensor([-1.0]), torch.ones(1, 2), dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 + math.exp(0.1)) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, math.exp(0.1) / 2]]))
    assert m["clip_frac_dual"].item() == pytest.approx(0.5)


def test_grpo_kl_term_value_and_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    loss, m = grpo_loss(logp, logp.detach(), ref, torch.zeros(1), torch.ones(1, 2), kl_coef=0.5, kl_estimator="k1")
    # A = 0: only the KL term. k1 = logp - ref = [0.5, -1.0] -> mean -0.25, times 0.5
    assert loss.item() == pytest.approx(0.5 * -0.25)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.25, 0.25]]))
    assert m["kl_ref"].item() == pytest.approx(-0.25)


@pytest.mark.parametrize(
    "mode, per_token",
    [
        ("token-mean", [1 / 5] * 5),  # every token alike: the long sequence counts 4x
        ("seq-mean-token-mean", [1 / 8] * 4 + [1 / 2]),  # every sequence alike: short tokens weigh more
        ("seq-mean-token-sum", [1 / 2] * 5),  # sum per sequence, mean over sequences
        ("seq-mean-token-sum-norm", [1 / (2 * 10)] * 5),  # Dr. GRPO: / (N x norm_length = 10)
    ],
)
def test_aggregation_gradient_weights_long_and_short_sequences(mode, per_token):
    logp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    loss, _ = grpo_loss(logp, logp.detach(), None, torch.tensor([-1.0, -1.0]), mask, loss_agg=mode, norm_length=10)
    loss.backward()  # ratio 1, A = -1: d loss / d logp = token weight
    assert torch.allclose(logp.grad[mask.bool()], torch.tensor(per_token))


# ------------------------------------------------------------------------ GSPO
def test_gspo_matches_hand_computation_and_gradient():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.3, 0.0], [-0.5, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    loss, m = gspo_loss(logp, old, None, adv, mask, clip_low=0.2, clip_high=0.2)
    s0, s1 = math.exp((0.5 + 0.3) / 2), math.exp(-0.5 / 3)  # 1.49 (A > 0: clipped at 1.2), 0.846 (inside)
    assert loss.item() == pytest.approx((-1.2 + s1) / 2, abs=1e-6)
    loss.backward()
    # sequence 0 clipped: no gradient; sequence 1: d/dlogp_t of (1/2) * s1 = s1 / (2 * 3) per token
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [s1 / 6] * 3]), atol=1e-6)
    assert m["ratio_max"].item() == pytest.approx(s0, rel=1e-6) and m["ratio_min"].item() == pytest.approx(s1, rel=1e-6)
    assert m["clip_frac_high"].item() == pytest.approx(0.5) and m["clip_frac_low"].item() == 0.0


def test_gspo_token_form_equals_sequence_level_gspo():
    torch.manual_seed(0)
    logp = (-torch.rand(3, 6)).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(3, 6)
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0]])
    adv = torch.tensor([1.0, -0.5, 2.0])
    loss, _ = gspo_loss(logp, old, None, adv, mask, clip_low=10.0, clip_high=10.0)  # no clipping
    (g_token,) = torch.autograd.grad(loss, logp)
    n = mask.sum(-1)
    s = torch.exp(((logp - old) * mask).sum(-1) / n)  # the sequence ratio, differentiated as a whole
    (g_seq,) = torch.autograd.grad((-adv * s).mean(), logp)
    assert torch.allclose(g_token, g_seq, atol=1e-6)


def test_gspo_ratio_is_invariant_to_token_order():
    torch.manual_seed(1)
    logp, old = -torch.rand(2, 5), -torch.rand(2, 5)
    mask, adv = torch.ones(2, 5), torch.tensor([1.0, -1.0])
    perm = torch.randperm(5)
    a, ma = gspo_loss(logp, old, None, adv, mask, clip_low=0.5, clip_high=0.5)
    b, mb = gspo_loss(logp[:, perm], old[:, perm], None, adv, mask, clip_low=0.5, clip_high=0.5)
    assert a.item() == pytest.approx(b.item(), abs=1e-6)
    assert ma["ratio_mean"].item() == pytest.approx(mb["ratio_mean"].item())


def test_gspo_weighs_sequences_equally_whatever_their_length():
    logp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    loss, _ = GSPO(clip_low=0.1, clip_high=0.1)(logp, logp.detach(), None, torch.tensor([-1.0, -1.0]), mask)
    loss.backward()
    per_sequence = logp.grad.sum(-1)
    assert torch.allclose(per_sequence, torch.tensor([0.5, 0.5]))  # each sequence 1/N in total
    assert GSPO.loss_agg == "seq-mean-token-mean"


def test_gspo_defaults_and_registry():
    g = GSPO()
    assert (g.clip_low, g.clip_high, g.kl_coef) == (3e-4, 4e-4, 0.0) and not g.needs_reference
    assert OBJECTIVES["gspo"] is GSPO and OBJECTIVES["grpo"] is GRPO


# ---------------------------------------------------------- importance weights
def test_sequence_importance_weight_is_a_capped_geometric_mean():
    logp = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    behaviour = torch.tensor([[-1.2, -1.4], [-3.0, -2.0]])
    mask = torch.tensor([[1, 1], [1, 1]])
    w = sequence_importance_weight(logp, behaviour, mask, cap=2.0)
    assert w[0].item() == pytest.approx(math.exp(0.3)) and w[1].item() == 2.0  # e^2 capped


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"clip_low": -1e-4}, "objective.clip_low"),
        ({"clip_high": -1.0}, "objective.clip_high"),
        ({"kl_coef": -0.1}, "objective.kl_coef"),
        ({"kl_estimator": "k9"}, "objective.kl_estimator"),
    ],
)
def test_bad_gspo_config_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        GSPO(**kwargs)


def test_bad_norm_length_names_the_key():
    with pytest.raises(ValueError, match="objective.norm_length"):
        GRPO(loss_agg="seq-mean-token-sum-norm", norm_length=0)
