"""Group-relative advantage estimators: one scalar per rollout from the rewards of its group.

Rows are stored group by group (G consecutive rows share a prompt).
"""

from __future__ import annotations

import torch

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "batch_std")


def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Advantages [N] for rewards [N] in groups of ``group_size``.

    - ``grpo``: ``(r - mean_group) / (std_group + eps)``.
    - ``dr_grpo``: ``r - mean_group`` (Dr. GRPO: no std normalization, no difficulty bias).
    - ``batch_std``: ``(r - mean_group) / (std_batch + eps)`` (one scale for the whole batch).

    A group whose rewards are all equal gets zero advantage under every estimator.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    centered = r - r.mean(-1, keepdim=True)
    if estimator == "grpo":
        std = r.std(-1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        return (centered / (std + eps)).view(-1)
    if estimator == "dr_grpo":
        return centered.view(-1)
    if estimator == "batch_std":
        return (centered / (rewards.float().std() + eps)).view(-1)
    raise ValueError(f"objective.advantage={estimator!r} is unknown: allowed {list(ADVANTAGE_ESTIMATORS)}")


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool: groups whose rewards are all equal (no learning signal)."""
    r = rewards.view(-1, group_size)
    return (r == r[:, :1]).all(-1)
