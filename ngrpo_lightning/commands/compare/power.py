"""A sweep's power on two arms: the smallest difference it detects, a verdict, and the seeds or problems a target needs.

Paired differences (:func:`.stats.paired_differences`) get a t interval over the seeds' means
(:func:`.stats.seed_interval`); a difference is *seen* when it excludes 0. S seeds of M problems::

    SE^2(S, M) = (v_seed + v_problem / M) / S

``v_problem`` is the pooled within-seed variance, ``v_seed`` the seeds' extra spread. A true
difference D is seen with probability ``power`` (80%) at level ``alpha`` (5%) when::

    D = (t_{S-1}(1 - alpha/2) + t_{S-1}(power)) * SE(S, M)

the *minimum detectable difference* (MDD). A plan solves it for the seeds or the problems per seed that reach a wanted
difference; past a point only seeds help (``v_seed / S``). With one seed ``v_seed`` is unknown and taken as 0."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import t as t_dist

from ngrpo_lightning.commands.compare.stats import seed_interval

MAX_PLAN = 10_000  # seeds or problems beyond this are reported as "more than"


@dataclass
class Detection:
    """A paired comparison's estimate, interval and what its design can detect (fractions, not %)."""

    diff: float
    low: float
    high: float
    se: float
    mdd: float  # minimum detectable difference at ``power`` and ``level``
    seeds: int
    problems: float  # per seed (harmonic mean when seeds differ)
    var_seed: float
    var_problem: float
    level: float
    power: float
    p_value: float = float("nan")  # two-sided t test of a difference of 0
    dof: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _quantiles(dof: float, level: float, power: float) -> float:
    """``t(1 - alpha/2) + t(power)``, the MDD in standard errors (2.80 for many dof at 95%, 80%)."""
    return float(t_dist.ppf(1 - (1 - level) / 2, dof) + t_dist.ppf(power, dof))


def detection(groups: Sequence[Sequence[float]], level: float = 0.95, power: float = 0.8) -> Detection:
    """The paired differences ``groups`` (one list per seed): mean, interval, MDD, variance components."""
    groups = [np.asarray(g, dtype=float) for g in groups if len(g)]
    interval = seed_interval(groups, level)
    nan = float("nan")
    if not groups:
        return Detection(nan, nan, nan, nan, nan, 0, 0.0, nan, nan, level, power)
    sizes = np.array([len(g) for g in groups], dtype=float)
    problems = float(len(sizes) / np.sum(1 / sizes))
    dof = float(np.sum(sizes - 1))
    var_problem = float(sum(((g - g.mean()) ** 2).sum() for g in groups) / dof) if dof > 0 else 0.0
    means = np.array([g.mean() for g in groups])
    var_seed = max(float(means.var(ddof=1)) - var_problem / problems, 0.0) if len(groups) > 1 else 0.0
    # no spread (every paired difference the same): nothing to say what the design detects
    mdd_now = _quantiles(interval.dof, level, power) * interval.se if interval.dof and interval.se > 0 else nan
    p_value = nan
    if interval.dof:
        p_value = 1.0 if interval.se == 0 and interval.mean == 0 else 0.0 if interval.se == 0 else None
        if p_value is None:
            p_value = float(2 * t_dist.sf(abs(interval.mean) / interval.se, interval.dof))
    return Detection(
        interval.mean,
        interval.low,
        interval.high,
        interval.se,
        mdd_now,
        len(groups),
        problems,
        var_seed,
        var_problem,
        level,
        power,
        p_value,
        interval.dof,
    )


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of ``p_values`` (NaN kept), for a family of comparisons."""
    order = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    out, running = list(p_values), 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p))
        out[i] = running
    return out


def planned_se(d: Detection, seeds: int, problems: float) -> float:
    """SE(S, M) of a sweep of ``seeds`` seeds of ``problems`` problems, from ``d``'s variance components."""
    return math.sqrt((d.var_seed + d.var_problem / problems) / seeds)


def mdd(d: Detection, seeds: int, problems: float) -> float:
    """The minimum detectable difference of a sweep of ``seeds`` seeds of ``problems`` problems."""
    return _quantiles(max(seeds - 1, 1), d.level, d.power) * planned_se(d, seeds, problems)


def joint_bound(found: list[Detection]) -> float:
    """The largest difference ``found``'s intervals allow, Bonferroni-widened so verdicts hold jointly (or NaN)."""
    usable = [d for d in found if d.dof and not math.isnan(d.se)]
    if not usable:
        return float("nan")
    alpha = (1 - usable[0].level) / len(usable)
    return max(abs(d.diff) + float(t_dist.ppf(1 - alpha / 2, d.dof)) * d.se for d in usable)


def seeds_needed(d: Detection, wanted: float) -> int | None:
    """The fewest seeds (>= 2, at this sweep's problems per seed) with MDD <= ``wanted``; None past :data:`MAX_PLAN`."""
    return _smallest(lambda s: mdd(d, s, d.problems) <= wanted, 2)


def problems_needed(d: Detection, wanted: float) -> int | None:
    """The fewest problems per seed (at this sweep's seeds) whose MDD is at most ``wanted``; None
    when the seeds' own spread keeps it above (more problems cannot help) or past :data:`MAX_PLAN`."""
    return _smallest(lambda m: mdd(d, max(d.seeds, 2), m) <= wanted, 1)


def _smallest(ok, low: int) -> int | None:
    """The smallest integer in [low, MAX_PLAN] where the monotone ``ok`` holds (bisection)."""
    if not ok(MAX_PLAN):
        return None
    high = MAX_PLAN
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if ok(mid) else (mid + 1, high)
    return low


def plan_text(d: Detection, wanted: float) -> str:
    """``about N seeds (or M validation problems per seed at S seeds)``: what detects ``wanted``;
    no plan without pairs, or without a spread to plan with (every paired difference the same)."""
    if d.seeds == 0 or d.problems <= 0:
        return "no plan: no problem evaluated by both arms"
    if not d.var_seed + d.var_problem > 0:  # 0, or NaN
        return "no plan: the paired differences have no spread to plan with"
    seeds, problems = seeds_needed(d, wanted), problems_needed(d, wanted)
    more_seeds = f"about {seeds} seeds" if seeds else f"more than {MAX_PLAN} seeds"
    at = max(d.seeds, 2)
    more_problems = (
        f"{problems} validation problem{'s' if problems > 1 else ''} per seed at {at} seeds"
        if problems
        else f"no number of problems at {at} seeds: their spread alone is too large"
    )
    return f"{more_seeds} (or {more_problems})"


def _half_width(d: Detection, seeds: int) -> float:
    """The interval's half-width at ``seeds`` seeds of this sweep's problems (the planning SE)."""
    return float(t_dist.ppf(1 - (1 - d.level) / 2, max(seeds - 1, 1))) * planned_se(d, seeds, d.problems)


def seeds_to_conclude(d: Detection, target: float) -> tuple[int | None, int | None]:
    """``(to bound, to show)``: at today's estimate, the fewest seeds whose interval would lie within +-``target``
    (None for an estimate >= ``target``, or past :data:`MAX_PLAN`), and the fewest whose interval would exclude 0 (None
    for an estimate of 0). A projection (not a power calculation) of how far an inconclusive sweep is from a verdict."""
    if math.isnan(d.diff) or d.problems <= 0 or not d.se > 0 or not d.var_seed + d.var_problem > 0:
        return None, None  # no spread to project with: no number of seeds can be said (the verdict says why)
    size = abs(d.diff)
    bound = _smallest(lambda s: size + _half_width(d, s) <= target, 2) if size < target else None
    show = _smallest(lambda s: _half_width(d, s) < size, 2) if size > 0 else None
    return bound, show


def conclusion_text(d: Detection, target: float) -> str:
    """``at the estimate of X, about N seeds would bound it within T (M would show it)``."""
    bound, show = seeds_to_conclude(d, target)
    pts = f"{100 * target:.1f}"
    first = (
        f"about {bound} seeds would bound it within {pts}"
        if bound
        else f"no number of seeds would bound it within {pts}"
    )
    second = f"about {show} would show it" if show else "none would show it"
    return f"at the estimate of {100 * d.diff:+.1f}, {first} ({second})"


ONE_SEED = " (one seed: its problems are the units, and the seeds' spread is unknown, taken as 0)"


def verdict_kind(d: Detection, target: float) -> str:
    """``greater``, ``bounded``, ``inconclusive`` or ``none``: :func:`verdict`'s class without its text."""
    if math.isnan(d.diff):
        return "none"
    if d.low > 0 or d.high < 0:
        return "greater"
    if d.se == 0:  # every paired difference 0 (both arms all wrong, say): no spread to bound one with
        return "inconclusive"
    return "bounded" if max(abs(d.low), abs(d.high)) <= target else "inconclusive"


def verdict(a: str, b: str, d: Detection, target: float) -> dict:
    """One line on ``a - b``: a difference the interval shows, a bound on it, or what is missing.

    * ``greater``: the interval excludes 0 (``a > b by X points``);
    * ``bounded``: it holds 0 and nothing beyond ``target``;
    * ``inconclusive``: it holds values beyond ``target``, or cannot be computed (no spread); the
      plan says what would detect ``target`` at 80% power."""
    pts = lambda v: f"{100 * v:.1f}"  # noqa: E731
    interval = f"[{100 * d.low:+.1f}, {100 * d.high:+.1f}]"
    kind = verdict_kind(d, target)
    if kind == "none":
        return {"kind": "none", "text": "no problem evaluated by both arms"}
    if kind == "greater":
        hi, lo, (low, high) = (a, b, (d.low, d.high)) if d.low > 0 else (b, a, (-d.high, -d.low))
        text = f"{hi} > {lo} by {pts(abs(d.diff))} points [{100 * low:+.1f}, {100 * high:+.1f}]"
        return {"kind": "greater", "winner": hi, "text": text + (ONE_SEED if d.seeds < 2 else "")}
    if kind == "bounded":
        text = f"no difference larger than {pts(max(abs(d.low), abs(d.high)))} points {interval}"
        return {"kind": "bounded", "text": text + (ONE_SEED if d.seeds < 2 else "")}
    if d.se == 0:
        return {
            "kind": "inconclusive",
            "text": f"inconclusive {interval}: both arms scored alike on every problem of every seed, which "
            "leaves no spread to bound a difference with; only problems that the arms solve at different "
            "rates (more samples per problem, more or harder problems, more seeds) can bound one.",
        }
    now = f"this sweep detects {pts(d.mdd)}" if not math.isnan(d.mdd) else "too few data to say what it detects"
    return {
        "kind": "inconclusive",
        "text": f"inconclusive {interval}, {now}: {plan_text(d, target)} would detect {pts(target)}; "
        + conclusion_text(d, target)
        + (ONE_SEED if d.seeds < 2 else ""),
    }
