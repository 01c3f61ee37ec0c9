"""Policy objectives: losses as pure functions, selected by name (see :mod:`.base`)."""

from ngrpo_lightning.objectives.advantages import (
    ADVANTAGE_ESTIMATORS,
    check_advantage,
    group_advantages,
    register_advantage,
    resolve_advantage,
    zero_variance_groups,
)
from ngrpo_lightning.objectives.aggregation import AGGREGATIONS, aggregate, masked_max, masked_mean, masked_min
from ngrpo_lightning.objectives.base import (
    OBJECTIVES,
    PolicyObjective,
    check_objective,
    check_objective_choice,
    check_objective_key,
    register_objective,
)
from ngrpo_lightning.objectives.grpo import GRPO, grpo_loss
from ngrpo_lightning.objectives.gspo import GSPO, gspo_loss, sequence_log_ratio
from ngrpo_lightning.objectives.importance import rollout_importance_weights, sequence_importance_weight
from ngrpo_lightning.objectives.kl import KL_ESTIMATORS, kl_penalty

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "GRPO",
    "GSPO",
    "KL_ESTIMATORS",
    "OBJECTIVES",
    "PolicyObjective",
    "aggregate",
    "check_objective",
    "check_objective_choice",
    "check_objective_key",
    "check_advantage",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "kl_penalty",
    "masked_max",
    "masked_mean",
    "masked_min",
    "register_advantage",
    "register_objective",
    "resolve_advantage",
    "rollout_importance_weights",
    "sequence_importance_weight",
    "sequence_log_ratio",
    "zero_variance_groups",
]
