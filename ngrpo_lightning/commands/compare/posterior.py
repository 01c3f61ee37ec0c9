"""Posterior Pass@k per arm, beside the unbiased estimator, and the rankings where they disagree.

With n samples of a problem, c correct, its success rate has the Beta posterior
``Beta(1 + c, 1 + n - c)`` (uniform prior), and pass@k = 1 - (1 - p)^k has a posterior mean in
closed form (:func:`ngrpo_lightning.metrics.posterior_pass_at_k`). An arm's posterior Pass@k is
the mean over its seeds of the mean over their problems; its 95% credible interval comes from
drawing every problem's rate from its posterior. The interval is the uncertainty left by n
samples per problem on these problems and seeds (the seeds' spread is in the t intervals of the
final table). With few samples per problem the unbiased estimator jumps between 0 and 1 on a
problem where the posterior moves smoothly, so rankings by the posterior are steadier
(arXiv 2510.04265); where the two rank arms differently, the report says so.
"""

from __future__ import annotations

import numpy as np

from ngrpo_lightning.metrics import posterior_pass_at_k

PRIOR = (1.0, 1.0)


def per_problem_counts(results: dict) -> list[tuple[int, int]]:
    """(n, c) of every problem of one run's Pass@k results.json, every evaluation set."""
    return [(p["n"], p["c"]) for block in results["sets"].values() for p in block["problems"]]


def posterior_interval(
    per_seed: list[list[tuple[int, int]]], k: int, draws: int = 4000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """(posterior mean, low, high) of an arm's Pass@k: mean over seeds of the mean over problems."""
    per_seed = [counts for counts in per_seed if counts]
    if not per_seed:
        return float("nan"), float("nan"), float("nan")
    mean = float(np.mean([np.mean([posterior_pass_at_k(n, c, k, PRIOR) for n, c in s]) for s in per_seed]))
    rng = np.random.default_rng(seed)
    total = np.zeros(draws)
    for counts in per_seed:
        n, c = np.array(counts, dtype=float).T
        p = rng.beta(PRIOR[0] + c, PRIOR[1] + n - c, size=(draws, len(counts)))
        total += (1 - (1 - p) ** k).mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(total / len(per_seed), [tail, 100 - tail])
    return mean, float(low), float(high)


def ranking_changes(unbiased: dict[str, float], posterior: dict[str, float]) -> list[tuple[str, str]]:
    """Pairs (a, b) that the unbiased estimator ranks a > b and the posterior b > a."""
    arms = sorted(unbiased)
    return [(a, b) for a in arms for b in arms if a != b and unbiased[a] > unbiased[b] and posterior[b] > posterior[a]]
