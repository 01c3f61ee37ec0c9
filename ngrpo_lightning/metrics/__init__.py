"""Metrics: exploration diagnostics of rollouts, and Pass@k / Mean@k / Maj@k."""

from .exploration import distinct_ngrams, edit_distance, exploration_metrics, mixture_entropy, pairwise_edit_distance
from .pass_at_k import PassAtK, maj_at_k, mean_at_k, pass_at_k, powers_of_two

__all__ = [
    "PassAtK",
    "distinct_ngrams",
    "edit_distance",
    "exploration_metrics",
    "maj_at_k",
    "mean_at_k",
    "mixture_entropy",
    "pairwise_edit_distance",
    "pass_at_k",
    "powers_of_two",
]
