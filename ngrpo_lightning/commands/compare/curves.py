"""Learning curves against compute, and the saturating fit that tells efficiency from ceiling.

Most design choices of an RL recipe change how fast it learns more than where it ends (ScaleRL,
arXiv 2510.13786), so at a fixed budget two arms can rank either way. Each arm's validation accuracy
is read against optimizer steps, generated tokens and wall time, and fitted with ScaleRL's curve::

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)

R0 the accuracy before training (not fitted), A the asymptote, C_mid the compute at half the gain,
B the slope; intervals from refitting on resampled seeds. The ceiling counts only when C_mid's
interval lies within the runs and A's below 1: an unbent curve tells its pace, not where it ends."""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass, field

import numpy as np

from ngrpo_lightning.commands.compare.runs import RunData

AXES = {"step": "optimizer steps", "tokens": "generated tokens", "minutes": "wall time (min)"}
PARAMS = ("asymptote", "midpoint", "slope")
SLOPE_RANGE = (0.3, 8.0)


def saturating(c, r0: float, asymptote: float, midpoint: float, slope: float) -> np.ndarray:
    """ScaleRL's curve at compute ``c`` (R0 at c = 0)."""
    c = np.asarray(c, dtype=float)
    with np.errstate(divide="ignore", over="ignore"):
        return r0 + (asymptote - r0) / (1 + (midpoint / np.maximum(c, 1e-300)) ** slope)


def compute_points(run: RunData, key: str = "val/accuracy") -> list[tuple[dict[str, float], float]]:
    """``key``'s points of one run, each as ({"step", "tokens", "minutes"}, value). A validation follows the optimizer
    steps whose training metrics were logged before it (its own step index is ambiguous); a Pass@k evaluation is
    logged at the steps done. Tokens are the rollout tokens generated so far (``rollout/tokens``), wall time counts
    from the first validation. A later point at the same step replaces an earlier one."""
    points = run.curves.get(key) or []
    train = run.curves.get("train/reward") or run.curves.get("rollout/tokens") or []
    train_times = sorted(m for _, m, _ in train)
    tokens = sorted((s, v) for s, _, v in run.curves.get("rollout/tokens") or [])
    first = run.curves.get("val/accuracy") or points
    start = min((m for _, m, _ in first), default=0.0)
    logged_after = "/pass_at_" in key
    out = {}
    for step, minutes, value in points:
        done = step if logged_after else bisect.bisect_right(train_times, minutes)
        spent = float(sum(v for s, v in tokens if s < done))
        out[done] = ({"step": float(done), "tokens": spent, "minutes": float(minutes - start)}, float(value))
    return [out[s] for s in sorted(out)]


@dataclass
class CurveFit:
    """One arm's fit on one axis; intervals are (low, high) per parameter of :data:`PARAMS`."""

    r0: float
    asymptote: float
    midpoint: float
    slope: float
    rmse: float
    seeds: int
    points: int
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    ceiling_identified: bool = True

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def fit_saturating(x, y, r0: float) -> tuple[np.ndarray, np.ndarray | None]:
    """(asymptote, midpoint, slope) of :func:`saturating` through points x > 0, R0 fixed; their covariance or None."""
    from scipy.optimize import curve_fit

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = x > 0
    x, y = x[keep], y[keep]
    span = (x.min() / 10, x.max() * 10)
    start = [float(np.clip(max(y.max(), r0 + 1e-3), 0.0, 1.0)), float(np.median(x)), 1.5]
    bounds = ([0.0, span[0], SLOPE_RANGE[0]], [1.0, span[1], SLOPE_RANGE[1]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "covariance could not be estimated": reported as no interval
        params, cov = curve_fit(
            lambda c, a, m, b: saturating(c, r0, a, m, b), x, y, p0=start, bounds=bounds, maxfev=20000
        )
    return params, (cov if np.all(np.isfinite(cov)) else None)


def fit_arm(seed_points: list[list[tuple[float, float]]], n_boot: int = 200, seed: int = 0) -> CurveFit | None:
    """The fit of one arm's seeds (each a list of (compute, value), compute 0 before training),
    with intervals; None when there are fewer than 3 points after the start or nothing changed."""
    seed_points = [p for p in seed_points if p]
    starts = [v for pts in seed_points for c, v in pts if c == 0]
    if not seed_points or sum(c > 0 for pts in seed_points for c, _ in pts) < 3:
        return None
    r0 = float(np.mean(starts)) if starts else float(min(v for pts in seed_points for _, v in pts))
    x = np.array([c for pts in seed_points for c, _ in pts])
    y = np.array([v for pts in seed_points for _, v in pts])
    if np.ptp(y) == 0:
        return None
    try:
        params, cov = fit_saturating(x, y, r0)
    except (RuntimeError, ValueError):
        return None
    rmse = float(np.sqrt(np.mean((saturating(x, r0, *params) - y) ** 2)))
    fit = CurveFit(r0, *map(float, params), rmse=rmse, seeds=len(seed_points), points=len(x))
    if len(seed_points) > 1:
        rng = np.random.default_rng(seed)
        draws = []
        for _ in range(n_boot):
            chosen = [seed_points[i] for i in rng.integers(0, len(seed_points), len(seed_points))]
            cx = np.array([c for pts in chosen for c, _ in pts])
            cy = np.array([v for pts in chosen for _, v in pts])
            starts_b = [v for pts in chosen for c, v in pts if c == 0]
            try:
                draws.append(fit_saturating(cx, cy, float(np.mean(starts_b)) if starts_b else r0)[0])
            except (RuntimeError, ValueError):
                continue
        if draws:
            low, high = np.percentile(np.array(draws), [2.5, 97.5], axis=0)
            fit.intervals = {p: (float(lo), float(hi)) for p, lo, hi in zip(PARAMS, low, high)}
    elif cov is not None:  # one seed: the fit's own covariance, cut to each parameter's range
        half = 1.96 * np.sqrt(np.diag(cov))
        span = (x[x > 0].min() / 10, x.max() * 10)
        ranges = ((0.0, 1.0), span, SLOPE_RANGE)
        fit.intervals = {
            p: (float(max(v - h, lo)), float(min(v + h, hi))) for p, v, h, (lo, hi) in zip(PARAMS, params, half, ranges)
        }
    # a ceiling is read from the data only when the curve passed its midpoint within the runs
    upper = fit.intervals.get("midpoint", (fit.midpoint, fit.midpoint))[1]
    fit.ceiling_identified = fit.intervals.get("asymptote", (0, 1.0))[1] < 0.999 and upper <= x.max()
    return fit


def arm_fits(runs: list[RunData], key: str = "val/accuracy", n_boot: int = 200, seed: int = 0) -> dict:
    """``{axis: {arm: CurveFit | None}}`` for every axis of :data:`AXES`."""
    arms = sorted({r.arm for r in runs})
    out = {}
    for axis in AXES:
        out[axis] = {}
        for arm in arms:
            per_seed = [[(c[axis], v) for c, v in compute_points(r, key)] for r in runs if r.arm == arm]
            out[axis][arm] = fit_arm(per_seed, n_boot, seed)
    return out


def _apart(a: tuple[float, float] | None, b: tuple[float, float] | None) -> int:
    """+1 when interval a lies above b, -1 below, 0 when they overlap or one is missing."""
    if not a or not b:
        return 0
    return 1 if a[0] > b[1] else -1 if a[1] < b[0] else 0


def contrast(a: str, b: str, fa: CurveFit | None, fb: CurveFit | None, axis: str) -> str:
    """What the two fits tell apart on ``axis``: the ceiling, the pace, both or neither."""
    if fa is None or fb is None:
        return "no fit for both arms"
    said = []
    if fa.ceiling_identified and fb.ceiling_identified:
        side = _apart(fa.intervals.get("asymptote"), fb.intervals.get("asymptote"))
        hi, lo = (a, b) if side > 0 else (b, a)
        said.append(f"{hi} has the higher ceiling" if side else "ceilings not told apart")
    else:
        said.append("a ceiling not reached within the runs")
    side = _apart(fa.intervals.get("midpoint"), fb.intervals.get("midpoint"))
    if side:
        fast, slow = (b, a) if side > 0 else (a, b)
        ratio = max(fa.midpoint, fb.midpoint) / min(fa.midpoint, fb.midpoint)
        said.append(f"{fast} reaches half its gain {ratio:.1f}x sooner in {AXES[axis]}")
    else:
        said.append("pace not told apart")
    return "; ".join(said)


def along_run_keys(runs: list[RunData]) -> list[str]:
    """Pass@1 and the largest Pass@k of each set evaluated along the runs (two evaluations or more)."""
    keys = {k for r in runs for k, points in r.curves.items() if "/pass_at_" in k and len(points) > 1}
    prefixes = sorted({k.rsplit("/", 1)[0] for k in keys})
    if len(prefixes) == 2 and "val/avg" in prefixes:  # one set: its average is itself
        prefixes.remove("val/avg")
    out = []
    for prefix in prefixes:
        ks = sorted(int(k.rsplit("_", 1)[1]) for k in keys if k.rsplit("/", 1)[0] == prefix)
        out += [f"{prefix}/pass_at_{k}" for k in sorted({ks[0], ks[-1]})]
    return out


def plot_compute(runs: list[RunData], fits: dict, path, keys: list[str] | None = None) -> None:
    """Each of ``keys`` (default ``val/accuracy`` and the Pass@k along the runs) against each axis of
    :data:`AXES`: per arm the mean over seeds, a min-max band and, for ``val/accuracy``, the fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = keys or ["val/accuracy", *along_run_keys(runs)]
    fig, axes = plt.subplots(len(keys), len(AXES), figsize=(4.4 * len(AXES), 3.3 * len(keys)), squeeze=False)
    for row, key in zip(axes, keys):
        for ax, axis in zip(row, AXES):
            _plot_key(ax, runs, fits if key == "val/accuracy" else {}, key, axis)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("mean over seeds, band lowest to highest seed, fitted saturating curve (dashed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_key(ax, runs: list[RunData], fits: dict, key: str, axis: str) -> None:
    for arm in sorted({r.arm for r in runs}):
        by_step: dict[float, list[tuple[float, float]]] = {}
        for r in runs:
            if r.arm == arm:
                for c, v in compute_points(r, key):
                    by_step.setdefault(c["step"], []).append((c[axis], v))
        if not by_step:
            continue
        steps = sorted(by_step)
        xs = np.array([np.mean([c for c, _ in by_step[s]]) for s in steps])
        vals = [[v for _, v in by_step[s]] for s in steps]
        line = ax.plot(xs, [np.mean(v) for v in vals], marker=".", label=arm)[0]
        ax.fill_between(xs, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.15)
        fit = fits.get(axis, {}).get(arm)
        if fit is not None:
            grid = np.linspace(0, xs.max(), 100)
            fitted = saturating(grid, fit.r0, fit.asymptote, fit.midpoint, fit.slope)
            ax.plot(grid, fitted, "--", color=line.get_color())
    ax.set_xlabel(AXES[axis])
    ax.set_ylabel(key.replace("pass_at_", "pass@"))
    ax.grid(alpha=0.3)
