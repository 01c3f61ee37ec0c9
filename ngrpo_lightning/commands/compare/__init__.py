"""``ngrpo compare``: trained arms (explorer x objective, across seeds) side by side, from MLflow."""

from ngrpo_lightning.commands.compare.command import run_compare
from ngrpo_lightning.commands.compare.stats import paired_differences, per_problem_scores, seed_interval

__all__ = ["paired_differences", "per_problem_scores", "run_compare", "seed_interval"]
