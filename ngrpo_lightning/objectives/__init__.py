"""Policy objectives: losses as pure functions, selected by name (see :mod:`.base`)."""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    group_advantages,
    register_advantage,
    resolve_advantage,
    zero_variance_groups,
)
from .aggregation import AGGREGATIONS, aggregate, masked_mean
from .base import OBJECTIVES, PolicyObjective, check_objective_choice, check_objective_key, register_objective
from .grpo import GRPO, grpo_loss
from .gspo import GSPO, gspo_loss, sequence_log_ratio
from .importance import rollout_importance_weights, sequence_importance_weight
from .kl import KL_ESTIMATORS, kl_penalty

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "GRPO",
    "GSPO",
    "KL_ESTIMATORS",
    "OBJECTIVES",
    "PolicyObjective",
    "aggregate",
    "check_objective_choice",
    "check_objective_key",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "kl_penalty",
    "masked_mean",
    "register_advantage",
    "register_objective",
    "resolve_advantage",
    "rollout_importance_weights",
    "sequence_importance_weight",
    "sequence_log_ratio",
    "zero_variance_groups",
]
