"""GRPO: PPO-clipped token-level surrogate with an optional KL penalty to a reference.

Per token, with ratio ``r = exp(logp - old_logp)`` and sequence advantage ``A``::

    pg  = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
    pg  = min(pg, -A * dual_clip)              if A < 0 and dual_clip is set
    tok = pg + kl_coef * KL_est(logp, ref_logp)
    loss = aggregate(tok, mask, loss_agg, norm_length)

``clip_high > clip_low``: DAPO's clip-higher; with ``r == 1`` and no KL the gradient is ``-A * grad logp``."""

from __future__ import annotations

import torch

from ngrpo_lightning.objectives.aggregation import AGGREGATIONS, aggregate, masked_max, masked_mean, masked_min
from ngrpo_lightning.objectives.base import (
    PolicyObjective,
    check_objective_choice,
    check_objective_key,
    register_objective,
)
from ngrpo_lightning.objectives.kl import KL_ESTIMATORS, kl_penalty, reference_kl

MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: a safety clamp, far beyond any clip range


def grpo_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    mask,
    *,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    kl_coef=0.0,
    kl_estimator="k3",
    kl_clamp=None,
    loss_agg="token-mean",
    norm_length=None,
):
    """The GRPO loss and its metrics (see the module docstring)."""
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logp.dtype)  # [N] or per token [N, L]
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    per_token, metrics = pg, {}
    kl = reference_kl(logp, ref_logp, kl_coef, kl_estimator, kl_clamp)
    if kl is not None:
        per_token = per_token + kl_coef * kl
        metrics["kl_ref"] = masked_mean(kl.detach(), mask)
    loss = aggregate(per_token, mask, loss_agg, norm_length)
    with torch.no_grad():
        metrics.update(
            pg_loss=aggregate(pg.detach(), mask, loss_agg, norm_length),
            clip_frac_low=masked_mean(((ratio < 1 - clip_low) & (adv < 0)).float(), mask),
            clip_frac_high=masked_mean(((ratio > 1 + clip_high) & (adv > 0)).float(), mask),
            ratio_mean=masked_mean(ratio.detach(), mask),
            ratio_min=masked_min(ratio.detach(), mask, empty=1.0),
            ratio_max=masked_max(ratio.detach(), mask, empty=1.0),
            approx_kl_old=masked_mean(kl_penalty(logp.detach(), old_logp, "k3"), mask),
        )
        if dual_clip is not None:
            metrics["clip_frac_dual"] = masked_mean(((-adv * ratio > -adv * dual_clip) & (adv < 0)).float(), mask)
    return loss, metrics


@register_objective("grpo")
class GRPO(PolicyObjective):
    """GRPO objective (PPO clip + KL). See :func:`grpo_loss`.

    Args:
        clip_low / clip_high: clip range ``[1 - clip_low, 1 + clip_high]`` (paper: 0.2 / 0.2).
        dual_clip: cap of ``-A * r`` for negative advantages (verl's default 3.0; None = off).
        kl_coef: weight of the KL penalty; 0 = no reference model is loaded at all.
        kl_estimator: ``k1``, ``k2`` or ``k3``.
        kl_clamp: each token's KL estimate clamped to ``[-kl_clamp, kl_clamp]`` (verl's
            ``low_var_kl`` = k3 clamped at 10, the default; None = no clamp).
        loss_agg: one of ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``.
        norm_length: the constant length of ``seq-mean-token-sum-norm`` (Dr. GRPO: the maximum response length, e.g.
            ``rollout.max_new_tokens``); None = the batch's padded response length.
    """

    token_advantages = True  # accepts per-token advantages [N, L] (truncated importance sampling)

    def __init__(
        self,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=3.0,
        kl_coef=0.001,
        kl_estimator="k3",
        kl_clamp=10.0,
        loss_agg="token-mean",
        norm_length=None,
    ):
        check_objective_key("clip_low", clip_low)
        check_objective_key("clip_high", clip_high)
        check_objective_key("kl_coef", kl_coef)
        if dual_clip is not None and dual_clip <= 1.0:
            raise ValueError(f"objective.dual_clip={dual_clip!r} must be > 1 (or null to disable)")
        check_objective_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
        if kl_clamp is not None:
            check_objective_key("kl_clamp", kl_clamp, 1e-6)
        check_objective_choice("loss_agg", loss_agg, AGGREGATIONS)
        if norm_length is not None:
            check_objective_key("norm_length", norm_length, 1)
        self.clip_low, self.clip_high, self.dual_clip = float(clip_low), float(clip_high), dual_clip
        self.kl_coef, self.kl_estimator, self.loss_agg = float(kl_coef), kl_estimator, loss_agg
        self.kl_clamp = None if kl_clamp is None else float(kl_clamp)
        self.norm_length = None if norm_length is None else int(norm_length)

    def __call__(self, logp, old_logp, ref_logp, advantages, mask):
        return grpo_loss(logp, old_logp, ref_logp, advantages, mask, **vars(self))
