"""Importance weights of off-policy trajectories: replayed ones, and rollouts whose engine or
weights differ from the trainer's (``train.tis_*``, ``train.max_staleness``).

A replayed trajectory was sampled by an older *behaviour* policy (its log-probs stored with it). The objective's ratio
is taken against the *proximal* policy (the current step's start), so clipping behaves as on-policy; the mismatch is a
separate, detached, capped weight on the advantage ("decoupled" PPO)::

    w_i = min( exp( mean_t (logp_prox_it - logp_behaviour_it) ), cap )

The geometric-mean form is GSPO's sequence ratio: a product over hundreds of tokens vanishes or explodes."""

from __future__ import annotations

import torch

from ngrpo_lightning.objectives.gspo import sequence_log_ratio


@torch.no_grad()
def sequence_importance_weight(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Capped sequence importance weights [N] of ``pi(logp) / pi_behaviour`` (see module docstring)."""
    return torch.exp(sequence_log_ratio(logp, behaviour_logp, mask).clamp(max=20.0)).clamp(max=cap)


@torch.no_grad()
def rollout_importance_weights(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    fresh: torch.Tensor,
    cap: float,
    level: str = "token",
    mode: str = "truncate",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weights of ``pi(logp) / pi_rollout`` for the ``fresh`` rows (others get 1): [N, L] per ``token``,
    [N] per ``sequence`` (product) or ``geometric`` (geometric mean); ``mode``: ``truncate`` to ``cap``
    or ``mask`` (0 above it). Also their mean, max and share above the cap."""
    mask = mask.bool()
    if level == "token":
        ratio, fresh = torch.where(mask, logp - rollout_logp, 0.0).clamp(max=20.0).exp(), fresh[:, None] & mask
    elif level == "sequence":
        ratio = torch.where(mask, logp - rollout_logp, 0.0).sum(-1).clamp(max=20.0).exp()
    else:
        ratio = sequence_log_ratio(logp, rollout_logp, mask).clamp(max=20.0).exp()
    capped = ratio > cap
    weights = ratio.clamp(max=cap) if mode == "truncate" else torch.where(capped, 0.0, ratio)
    weights = torch.where(fresh, weights, torch.ones_like(weights))
    fresh_f = fresh.to(weights.dtype)
    count = fresh_f.sum().clamp(min=1.0)
    stats = {
        "tis_weight_mean": (weights * fresh_f).sum() / count,
        "tis_weight_max": torch.where(fresh, weights, 0.0).max(),
        "tis_clipped_frac": (capped.to(weights.dtype) * fresh_f).sum() / count,
    }
    return weights, stats
