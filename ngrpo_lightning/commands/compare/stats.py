"""Intervals over seeds, and the paired comparison of two arms.

An arm's final score is the mean over its seeds of the mean over each seed's problems. Seeds are the independent units
of a sweep, so intervals are t intervals over the seeds' means (:func:`seed_interval`), which carry every source of
spread; the paired comparison applies the same to per-problem *differences* between two arms. (A two-level bootstrap,
seeds then problems, miscounts both spreads: its intervals came out too narrow in simulation.)"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import t as t_dist

from ngrpo_lightning.metrics import maj_at_k, pass_at_k


def per_problem_scores(results: dict, k: int) -> dict[str, dict[str, float]]:
    """``{problem id: {"pass@k", "mean@n", "maj@n"}}`` from one run's results.json (ids prefixed by set)."""
    out = {}
    for name, block in results["sets"].items():
        for p in block["problems"]:
            correct = [s == "correct" for s in p["status"]]
            out[f"{name}/{p['id']}"] = {
                f"pass@{k}": pass_at_k(p["n"], p["c"], k),
                f"mean@{p['n']}": p["c"] / p["n"],
                f"maj@{p['n']}": maj_at_k(p["answers"], correct),
            }
    return out


@dataclass(frozen=True)
class Interval:
    """A mean over seeds of the means over each seed's problems, with its t interval."""

    mean: float
    low: float
    high: float
    se: float  # standard error of ``mean``
    dof: int  # degrees of freedom of its t quantile
    unit: str  # "seeds", or "problems" when there is one seed

    def __iter__(self):  # (mean, low, high), as the tables print it
        return iter((self.mean, self.low, self.high))


NAN_INTERVAL = Interval(math.nan, math.nan, math.nan, math.nan, 0, "seeds")


def seed_interval(
    groups: Sequence[Sequence[float]], level: float = 0.95, bounds: tuple[float, float] | None = None
) -> Interval:
    """The mean over groups (seeds) of the mean within each (problems), and its ``level`` t interval with the seeds as
    units: ``t_{S-1} * sd(seed means) / sqrt(S)``. ``bounds``: the values the quantity can take (a rate's ``(0, 1)``),
    to which the interval is cut. With one seed the problems are the units. Empty groups are left out."""
    groups = [np.asarray(g, dtype=float) for g in groups if len(g)]
    if not groups:
        return NAN_INTERVAL
    means = np.array([g.mean() for g in groups])
    units, unit = (means, "seeds") if len(groups) > 1 else (groups[0], "problems")
    if len(units) < 2:
        return Interval(float(means.mean()), math.nan, math.nan, math.nan, 0, unit)
    se = float(units.std(ddof=1) / math.sqrt(len(units)))
    dof = len(units) - 1
    half = float(t_dist.ppf(1 - (1 - level) / 2, dof)) * se
    mean = float(means.mean())
    low, high = mean - half, mean + half
    if bounds is not None:
        low, high = max(low, bounds[0]), min(high, bounds[1])
    return Interval(mean, low, high, se, dof, unit)


def seed_order(seed: str):
    """Seeds sort as numbers where they are numbers ("2" before "10"), by name otherwise."""
    return (0, int(seed), "") if str(seed).isdigit() else (1, 0, str(seed))


def paired_differences(a: dict[str, dict], b: dict[str, dict], metric: str) -> list[list[float]]:
    """Per seed (in :func:`seed_order`), the differences ``a - b`` of ``metric`` on the problems both
    arms evaluated; ``a`` and ``b`` map a seed to that run's :func:`per_problem_scores`."""
    out = []
    for seed in sorted(set(a) & set(b), key=seed_order):
        common = sorted(set(a[seed]) & set(b[seed]))
        out.append([a[seed][p][metric] - b[seed][p][metric] for p in common])
    return out
