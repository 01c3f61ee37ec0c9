"""Metrics: exploration diagnostics of rollouts (and, later, Pass@k)."""

from .exploration import distinct_ngrams, exploration_metrics, mixture_entropy

__all__ = ["distinct_ngrams", "exploration_metrics", "mixture_entropy"]
