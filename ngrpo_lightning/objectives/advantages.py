"""Group-relative advantage estimators: one scalar per rollout from the rewards of its group.

Estimators are pure functions ``(rewards [num_groups, G], eps) -> advantages [num_groups, G]``
in a registry, selected by name with the top-level config key ``advantage`` (like explorers
and objectives). Rows are stored group by group (G consecutive rows share a prompt). Add one::

    @register_advantage("my_estimator")
    def my_estimator(r: torch.Tensor, eps: float) -> torch.Tensor:
        return r - r.median(-1, keepdim=True).values
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..checks import check_choice

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "group_advantages",
    "register_advantage",
    "resolve_advantage",
    "zero_variance_groups",
]

Estimator = Callable[[torch.Tensor, float], torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}


def register_advantage(name: str, min_group_size: int = 2):
    """Function decorator: make an estimator selectable as ``advantage=<name>``. ``min_group_size``:
    the smallest ``rollout.group_size`` it learns from (2 for group-relative estimators)."""

    def wrap(fn: Estimator) -> Estimator:
        fn.min_group_size = min_group_size
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return wrap


def resolve_advantage(name: str) -> Estimator:
    """The estimator registered as ``name``; ``ValueError`` naming the ``advantage`` key and the allowed names."""
    return ADVANTAGE_ESTIMATORS[check_choice("advantage", name, ADVANTAGE_ESTIMATORS)]


@register_advantage("grpo")
def grpo_advantage(r: torch.Tensor, eps: float) -> torch.Tensor:
    """``(r - mean_group) / (std_group + eps)``."""
    std = r.std(-1, keepdim=True) if r.shape[-1] > 1 else torch.zeros_like(r[:, :1])
    return (r - r.mean(-1, keepdim=True)) / (std + eps)


@register_advantage("dr_grpo")
def dr_grpo_advantage(r: torch.Tensor, eps: float) -> torch.Tensor:
    """``r - mean_group`` (Dr. GRPO: no std normalization, no difficulty bias)."""
    return r - r.mean(-1, keepdim=True)


@register_advantage("batch_std")
def batch_std_advantage(r: torch.Tensor, eps: float) -> torch.Tensor:
    """``(r - mean_group) / (std_batch + eps)`` (one scale for the whole batch)."""
    return (r - r.mean(-1, keepdim=True)) / (r.std() + eps)


def group_advantages(
    rewards: torch.Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """Advantages [N] for rewards [N] in groups of ``group_size`` with the named estimator.

    A group whose rewards are all equal gets zero advantage under every built-in estimator.
    """
    fn = resolve_advantage(estimator)
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return fn(rewards.float().view(-1, group_size), eps).reshape(-1)


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool: groups whose rewards are all equal (no learning signal)."""
    r = rewards.view(-1, group_size)
    return (r == r[:, :1]).all(-1)
