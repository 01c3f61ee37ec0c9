"""Group-relative advantage estimators: one scalar per rollout from the rewards of its group.

Estimators are pure functions ``(rewards [num_groups, G], eps) -> advantages [num_groups, G]``, selected by
``advantage=<registered name | function path>``; G consecutive rows share a prompt. Add one::

    @register_advantage("my_estimator")
    def my_estimator(r: torch.Tensor, eps: float) -> torch.Tensor:
        return r - r.median(-1, keepdim=True).values
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ngrpo_lightning.registry import Registry, import_path

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "check_advantage",
    "group_advantages",
    "register_advantage",
    "resolve_advantage",
    "zero_variance_groups",
]

Estimator = Callable[[torch.Tensor, float], torch.Tensor]
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", key="advantage")


def register_advantage(name: str, min_group_size: int = 2):
    """Function decorator: make an estimator selectable as ``advantage=<name>``. ``min_group_size``:
    the smallest ``rollout.group_size`` it learns from (2 for group-relative estimators)."""
    return ADVANTAGE_ESTIMATORS.register(name, min_group_size=min_group_size)


def resolve_advantage(name: str) -> Estimator:
    """The estimator registered as ``name`` or a function path, else ``ValueError`` naming the key and allowed names."""
    if isinstance(name, str) and "." in name and name not in ADVANTAGE_ESTIMATORS:
        fn = import_path(name, "advantage")
        if not callable(fn):
            raise ValueError(f"advantage={name!r} is not a function (rewards [groups, G], eps) -> advantages")
        return fn
    return ADVANTAGE_ESTIMATORS.resolve(name)


def check_advantage(name: str, group_size: int) -> None:
    """Try the estimator on 2 made-up groups of ``group_size``: one advantage per reward or ``ValueError`` naming it."""
    rewards = torch.arange(2 * group_size, dtype=torch.float32).remainder(2).view(2, group_size)
    out = resolve_advantage(name)(rewards, 1e-6)
    _check_shape(name, out, rewards)


def _check_shape(name: str, out, rewards: torch.Tensor) -> None:
    if not torch.is_tensor(out) or out.shape != rewards.shape:
        got = f"shape {tuple(out.shape)}" if torch.is_tensor(out) else type(out).__name__
        raise ValueError(
            f"advantage={name}: the estimator returned {got} for rewards of shape {tuple(rewards.shape)}; "
            "it must return one advantage per reward, [groups, G]"
        )


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


@register_advantage("calibrated")
def calibrated_advantage(r: torch.Tensor, eps: float, max_reward: float = 1.0) -> torch.Tensor:
    """NGRPO's advantage calibration (Nan et al., arXiv 2509.18851): ``(r - mean') / (std' + eps)`` with mean and
    unbiased std over the G rewards plus one virtual sample of the maximum reward. An all-wrong group is no longer
    silent (0/1 rewards, G = 8: each sample gets -1/3); an all-correct group still gets 0."""
    augmented = torch.cat([r, r.new_full((r.shape[0], 1), max_reward)], dim=-1)
    return (r - augmented.mean(-1, keepdim=True)) / (augmented.std(-1, keepdim=True) + eps)


def group_advantages(
    rewards: torch.Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """Advantages [N] for rewards [N] in groups of ``group_size`` with the named estimator. A group of equal rewards
    gets zero advantage, except all-wrong groups under ``calibrated``."""
    fn = resolve_advantage(estimator)
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    out = fn(grouped, eps)
    _check_shape(estimator, out, grouped)
    return out.reshape(-1)


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool: groups whose rewards are all equal (no learning signal)."""
    r = rewards.view(-1, group_size)
    return (r == r[:, :1]).all(-1)
