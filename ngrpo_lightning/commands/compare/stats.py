"""Bootstrap confidence intervals over problems and seeds, and the paired comparison of two arms.

A final score of an arm is the mean over its seeds of the mean over that seed's problems (each
seed may hold different validation problems). Its interval resamples both levels: seeds with
replacement, then the problems of each drawn seed with replacement (a two-level bootstrap), so
seed-to-seed spread widens it as it should. The paired comparison applies the same to the
per-problem *differences* between two arms on the same seed and problem.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ngrpo_lightning.metrics import maj_at_k, pass_at_k


def per_problem_scores(results: dict, k: int) -> dict[str, dict[str, float]]:
    """``{problem id: {"pass@k", "mean@n", "maj@n"}}`` from one run's Pass@k results.json
    (every evaluation set, ids prefixed by the set's name)."""
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


def two_level_bootstrap(
    groups: Sequence[Sequence[float]], n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """(mean, low, high): the mean over groups (seeds) of the mean within each group (problems),
    and its percentile interval from resampling groups, then items within each drawn group."""
    groups = [np.asarray(g, dtype=float) for g in groups if len(g)]
    if not groups:
        return float("nan"), float("nan"), float("nan")
    point = float(np.mean([g.mean() for g in groups]))
    rng = np.random.default_rng(seed)
    stats = np.empty(n_boot)
    for b in range(n_boot):
        drawn = rng.integers(0, len(groups), len(groups))
        stats[b] = np.mean([groups[i][rng.integers(0, len(groups[i]), len(groups[i]))].mean() for i in drawn])
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(stats, [tail, 100 - tail])
    return point, float(low), float(high)


def paired_differences(a: dict[str, dict], b: dict[str, dict], metric: str) -> list[list[float]]:
    """Per seed, the differences ``a - b`` of ``metric`` on the problems both arms evaluated.

    ``a`` and ``b`` map a seed to that run's :func:`per_problem_scores`; seeds or problems only
    one arm has are left out (pairing needs both)."""
    out = []
    for seed in sorted(set(a) & set(b)):
        common = sorted(set(a[seed]) & set(b[seed]))
        out.append([a[seed][p][metric] - b[seed][p][metric] for p in common])
    return out
