"""Importance weights of off-policy (replayed) trajectories.

A trajectory replayed from an earlier step was sampled by an older policy (its
*behaviour* policy, whose log-probs were stored with it). The objective's ratio is taken
against the policy at the start of the current step (the *proximal* policy, as for fresh
rollouts), so clipping behaves as on-policy; the mismatch between proximal and behaviour
policies is a separate, detached, capped weight on the trajectory's advantage (the
"decoupled" PPO objective)::

    w_i = min( exp( mean_t (logp_prox_it - logp_behaviour_it) ), cap )

The length-normalized (geometric mean) form is GSPO's sequence ratio: a plain product of
token ratios over hundreds of tokens vanishes or explodes.
"""

from __future__ import annotations

import torch

from .gspo import sequence_log_ratio


@torch.no_grad()
def sequence_importance_weight(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Capped sequence importance weights [N] of ``pi(logp) / pi_behaviour`` (see module docstring)."""
    return torch.exp(sequence_log_ratio(logp, behaviour_logp, mask).clamp(max=20.0)).clamp(max=cap)
