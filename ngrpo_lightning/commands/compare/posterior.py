"""Posterior Pass@k per arm, beside the unbiased estimator, and the rankings where they disagree.

With n samples of a problem, c correct, its success rate has the Beta posterior
``Beta(a + c, b + n - c)``, and pass@k = 1 - (1 - p)^k has a posterior mean in closed form
(:func:`ngrpo_lightning.metrics.posterior_pass_at_k`). The prior ``Beta(a, b)`` is fitted to the
problems of every run compared (:func:`fit_beta_prior`, empirical Bayes, one prior for all arms):
a uniform prior would say a problem with 0 of 16 samples right has a posterior Pass@16 of 48%,
where on a task of mostly hard problems it is much lower. An arm's posterior Pass@k is the mean
over its seeds of the mean over their problems; its 95% credible interval comes from drawing
every problem's rate from its posterior: the uncertainty left by n samples per problem on these
problems and seeds (the seeds' spread is in the t intervals of the final table). With few
samples per problem the unbiased estimator jumps between 0 and 1 on a problem where the
posterior moves smoothly, so rankings by the posterior are steadier (arXiv 2510.04265); where
the two rank arms differently, the report says so.
"""

from __future__ import annotations

import numpy as np

from ngrpo_lightning.metrics import posterior_pass_at_k

UNIFORM = (1.0, 1.0)


def fit_beta_prior(counts: list[tuple[int, int]]) -> tuple[float, float]:
    """``(a, b)`` of a Beta distribution of the problems' success rates, by the method of moments
    on ``c / n`` with the binomial noise of n samples taken out; the uniform prior when the
    rates do not vary more than that noise (or there are fewer than two problems)."""
    if len(counts) < 2:
        return UNIFORM
    n, c = np.array(counts, dtype=float).T
    rates = c / n
    mean = float(rates.mean())
    if not 0 < mean < 1:
        return UNIFORM
    spread = float(rates.var(ddof=1)) - float(np.mean(rates * (1 - rates) / np.maximum(n - 1, 1)))
    if spread <= 0:
        return UNIFORM
    total = max(mean * (1 - mean) / spread - 1, 0.1)  # at most mean (1 - mean): every problem all or nothing
    return max(mean * total, 0.01), max((1 - mean) * total, 0.01)


def per_problem_counts(results: dict) -> list[tuple[int, int]]:
    """(n, c) of every problem of one run's Pass@k results.json, every evaluation set."""
    return [(p["n"], p["c"]) for block in results["sets"].values() for p in block["problems"]]


def posterior_interval(
    per_seed: list[list[tuple[int, int]]],
    k: int,
    draws: int = 4000,
    seed: int = 0,
    level: float = 0.95,
    prior: tuple[float, float] = UNIFORM,
) -> tuple[float, float, float]:
    """(posterior mean, low, high) of an arm's Pass@k: mean over seeds of the mean over problems."""
    per_seed = [counts for counts in per_seed if counts]
    if not per_seed:
        return float("nan"), float("nan"), float("nan")
    mean = float(np.mean([np.mean([posterior_pass_at_k(n, c, k, prior) for n, c in s]) for s in per_seed]))
    rng = np.random.default_rng(seed)
    total = np.zeros(draws)
    for counts in per_seed:
        n, c = np.array(counts, dtype=float).T
        p = rng.beta(prior[0] + c, prior[1] + n - c, size=(draws, len(counts)))
        total += (1 - (1 - p) ** k).mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(total / len(per_seed), [tail, 100 - tail])
    return mean, float(low), float(high)


def ranking_changes(unbiased: dict[str, float], posterior: dict[str, float]) -> list[tuple[str, str]]:
    """Pairs (a, b) that the unbiased estimator ranks a > b and the posterior b > a."""
    arms = sorted(unbiased)
    return [(a, b) for a in arms for b in arms if a != b and unbiased[a] > unbiased[b] and posterior[b] > posterior[a]]
