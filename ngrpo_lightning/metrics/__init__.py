"""Metrics: exploration diagnostics of rollouts, a training step's rollout statistics, and Pass@k / Mean@k / Maj@k."""

from ngrpo_lightning.metrics.exploration import (
    distinct_ngrams,
    edit_distance,
    exploration_metrics,
    mixture_entropy,
    pairwise_edit_distance,
)
from ngrpo_lightning.metrics.pass_at_k import (
    PassAtK,
    maj_at_k,
    mean_at_k,
    pass_at_k,
    posterior_pass_at_k,
    powers_of_two,
)
from ngrpo_lightning.metrics.training import combine_metrics, rollout_step_metrics

__all__ = [
    "PassAtK",
    "combine_metrics",
    "distinct_ngrams",
    "edit_distance",
    "exploration_metrics",
    "maj_at_k",
    "mean_at_k",
    "mixture_entropy",
    "pairwise_edit_distance",
    "pass_at_k",
    "posterior_pass_at_k",
    "powers_of_two",
    "rollout_step_metrics",
]
