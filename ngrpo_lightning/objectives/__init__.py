"""Policy objectives: losses as pure functions, selected by name (see :mod:`.base`)."""

from .advantages import ADVANTAGE_ESTIMATORS, group_advantages, zero_variance_groups
from .aggregation import AGGREGATIONS, aggregate, masked_mean
from .base import OBJECTIVES, PolicyObjective, register_objective
from .grpo import GRPO, grpo_loss
from .kl import KL_ESTIMATORS, kl_penalty

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "GRPO", "KL_ESTIMATORS", "OBJECTIVES", "PolicyObjective",
    "aggregate", "group_advantages", "grpo_loss", "kl_penalty", "masked_mean", "register_objective",
    "zero_variance_groups",
]
