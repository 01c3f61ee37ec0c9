"""``ngrpo compare``: trained arms (explorer x objective, across seeds) side by side, from MLflow."""

from .command import run_compare
from .stats import paired_differences, per_problem_scores, two_level_bootstrap

__all__ = ["paired_differences", "per_problem_scores", "run_compare", "two_level_bootstrap"]
