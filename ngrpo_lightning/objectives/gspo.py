"""GSPO: Group Sequence Policy Optimization (Zheng et al., 2025).

The importance ratio is a sequence's, length-normalized (a geometric mean of token ratios)::

    s_i = exp( mean_t (logp_it - old_logp_it) )

clipped per sequence. The loss is the paper's straight-through GSPO-token form (GSPO's when tokens share A_i)::

    s_it = sg[s_i] * exp(logp_it - sg[logp_it])          (value s_i, gradient s_i * grad logp_it)
    pg_it = max(-A_i * s_it, -A_i * clip(s_it, 1 - clip_low, 1 + clip_high))
    loss  = mean_i mean_t (pg_it + kl_coef * KL_est_it)    (seq-mean-token-mean)

Unclipped, the gradient is ``-A_i * s_i * mean_t grad logp_it``: every token of a sequence weighs
the same. The paper's clip ranges are tiny (3e-4 / 4e-4) because a sequence ratio is an average."""

from __future__ import annotations

import torch

from ngrpo_lightning.objectives.aggregation import aggregate, masked_max, masked_mean, masked_min
from ngrpo_lightning.objectives.base import (
    PolicyObjective,
    check_objective_choice,
    check_objective_key,
    register_objective,
)
from ngrpo_lightning.objectives.kl import KL_ESTIMATORS, kl_penalty, reference_kl

MAX_LOG_SEQ_RATIO = 10.0  # a safety clamp, as in the paper's reference code


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mean_t (logp - old_logp)`` over each sequence's response tokens ([N, L] -> [N])."""
    mask = mask.to(logp.dtype)
    return ((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def gspo_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    mask,
    *,
    clip_low=3e-4,
    clip_high=4e-4,
    kl_coef=0.0,
    kl_estimator="k3",
    kl_clamp=None,
):
    """The GSPO loss and its metrics (module docstring); ratio and clip metrics per sequence."""
    adv = advantages.to(logp.dtype)
    seq_log_ratio = sequence_log_ratio(logp, old_logp, mask).clamp(max=MAX_LOG_SEQ_RATIO)
    log_ratio_tok = seq_log_ratio.detach()[:, None] + logp - logp.detach()  # straight-through
    ratio_tok = torch.exp(log_ratio_tok)
    pg = torch.maximum(-adv[:, None] * ratio_tok, -adv[:, None] * ratio_tok.clamp(1.0 - clip_low, 1.0 + clip_high))
    per_token, metrics = pg, {}
    kl = reference_kl(logp, ref_logp, kl_coef, kl_estimator, kl_clamp)
    if kl is not None:
        per_token = per_token + kl_coef * kl
        metrics["kl_ref"] = masked_mean(kl.detach(), mask)
    loss = aggregate(per_token, mask, "seq-mean-token-mean")
    with torch.no_grad():
        seq_ratio = torch.exp(seq_log_ratio.detach())
        has_tokens = mask.sum(-1) > 0  # the sequences the statistics are over (none: ratio 1, no clipping)
        r = seq_ratio
        metrics.update(
            pg_loss=aggregate(pg.detach(), mask, "seq-mean-token-mean"),
            clip_frac_low=masked_mean(((r < 1 - clip_low) & (adv < 0)).float(), has_tokens),
            clip_frac_high=masked_mean(((r > 1 + clip_high) & (adv > 0)).float(), has_tokens),
            ratio_mean=torch.where(has_tokens.any(), masked_mean(r, has_tokens), r.new_tensor(1.0)),
            ratio_min=masked_min(r, has_tokens, empty=1.0),
            ratio_max=masked_max(r, has_tokens, empty=1.0),
            approx_kl_old=masked_mean(kl_penalty(logp.detach(), old_logp, "k3"), mask),
        )
    return loss, metrics


@register_objective("gspo")
class GSPO(PolicyObjective):
    """GSPO objective: sequence-level ratio and clip, sequence-mean aggregation (:func:`gspo_loss`).

    Args:
        clip_low / clip_high: sequence-ratio clip range ``[1 - clip_low, 1 + clip_high]`` (paper: 3e-4 / 4e-4).
        kl_coef: weight of a KL penalty to the reference (paper: 0 = no reference model).
        kl_estimator: ``k1``, ``k2`` or ``k3``.
        kl_clamp: each token's KL estimate clamped to ``[-kl_clamp, kl_clamp]`` (verl: 10; None = none).
    """

    loss_agg = "seq-mean-token-mean"

    def __init__(self, clip_low=3e-4, clip_high=4e-4, kl_coef=0.0, kl_estimator="k3", kl_clamp=10.0):
        check_objective_key("clip_low", clip_low)
        check_objective_key("clip_high", clip_high)
        check_objective_key("kl_coef", kl_coef)
        check_objective_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
        self.clip_low, self.clip_high = float(clip_low), float(clip_high)
        self.kl_coef, self.kl_estimator = float(kl_coef), kl_estimator
        if kl_clamp is not None:
            check_objective_key("kl_clamp", kl_clamp, 1e-6)
        self.kl_clamp = None if kl_clamp is None else float(kl_clamp)

    def __call__(self, logp, old_logp, ref_logp, advantages, mask):
        return gspo_loss(logp, old_logp, ref_logp, advantages, mask, **vars(self))
