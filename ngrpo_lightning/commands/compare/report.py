"""The comparison report: per-arm tables (final Pass@k with intervals, paired differences,
exploration, speed) and figures (learning curves against steps and wall time, Pass@k)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np

from ngrpo_lightning.commands.compare.runs import CURVES, EXPLORATION, SPEED, RunData
from ngrpo_lightning.commands.compare.stats import paired_differences, per_problem_scores, two_level_bootstrap


def arm_tables(runs: list[RunData], n_boot: int, seed: int) -> dict:
    """Everything the report shows, as plain data (also written as JSON)."""
    arms = sorted({r.arm for r in runs})
    by_arm = {a: [r for r in runs if r.arm == a] for a in arms}
    out = {"arms": {}, "paired": [], "ks": []}
    ns = {p["n"] for r in runs if r.pass_at_k for s in r.pass_at_k["sets"].values() for p in s["problems"]}
    n = min(ns) if ns else 0
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, n) if 1 <= k <= n})
    out["ks"], out["n"] = ks, n
    scores = {}  # arm -> metric -> seed -> {problem: value}
    for arm, members in by_arm.items():
        info = {"runs": [r.run_id for r in members], "seeds": sorted(r.seed for r in members), "final": {}}
        per_seed = {r.seed: _all_scores(r, ks) for r in members if r.pass_at_k}
        scores[arm] = per_seed
        metrics = [f"pass@{k}" for k in ks] + ([f"mean@{n}", f"maj@{n}"] if n else [])
        for m in metrics:
            groups = [[v[m] for v in per_seed[s].values()] for s in sorted(per_seed)]
            info["final"][m] = two_level_bootstrap(groups, n_boot, seed)
        info["problems"] = sum(len(v) for v in per_seed.values())
        for key in (*EXPLORATION, *SPEED):
            values = [_run_mean(r, key) for r in members]
            values = [v for v in values if not math.isnan(v)]
            info.setdefault("means", {})[key] = (float(np.mean(values)), float(np.std(values))) if values else None
        out["arms"][arm] = info
    main = f"pass@{ks[0]}" if ks else None
    for a, b in itertools.combinations(arms, 2):
        if not main:
            break
        for m in (main, f"pass@{ks[-1]}"):
            diffs = paired_differences(scores[a], scores[b], m)
            out["paired"].append(
                {
                    "a": a,
                    "b": b,
                    "metric": m,
                    "pairs": sum(map(len, diffs)),
                    "diff": two_level_bootstrap(diffs, n_boot, seed),
                }
            )
    return out


def _all_scores(run: RunData, ks: list[int]) -> dict[str, dict[str, float]]:
    merged: dict[str, dict[str, float]] = {}
    for k in ks:
        for pid, values in per_problem_scores(run.pass_at_k, k).items():
            merged.setdefault(pid, {}).update(values)
    return merged


def _run_mean(run: RunData, key: str) -> float:
    points = run.curves.get(key) or []
    return float(np.mean([v for _, _, v in points])) if points else math.nan


def markdown(tables: dict, runs: list[RunData], warnings: list[str], header: str) -> str:
    """The report as markdown."""
    ks, n = tables["ks"], tables["n"]
    lines = [header, ""]
    if warnings:
        lines += ["**Not comparable as they stand** (settings differ between runs):", ""]
        lines += [f"- {w}" for w in warnings] + [""]
    lines += ["| arm | seeds | runs | problems (x seeds) |", "|---|---|---:|---:|"]
    for arm, info in tables["arms"].items():
        lines.append(f"| {arm} | {', '.join(info['seeds'])} | {len(info['runs'])} | {info['problems']} |")
    if ks:
        metrics = [f"pass@{k}" for k in ks] + [f"mean@{n}", f"maj@{n}"]
        lines += [
            "",
            f"Final evaluation (n = {n} samples per problem), %: mean [95% bootstrap interval over problems"
            " and seeds]:",
            "",
        ]
        lines += ["| arm | " + " | ".join(m.capitalize() for m in metrics) + " |", "|---|" + "---:|" * len(metrics)]
        for arm, info in tables["arms"].items():
            cells = [_ci(info["final"].get(m)) for m in metrics]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        if tables["paired"]:
            lines += ["", "Paired differences (a - b, same seed and problem), percentage points [95% interval]:", ""]
            lines += ["| a | b | metric | pairs | a - b |", "|---|---|---|---:|---:|"]
            for p in tables["paired"]:
                lines.append(f"| {p['a']} | {p['b']} | {p['metric']} | {p['pairs']} | {_ci(p['diff'], signed=True)} |")
    else:
        lines += ["", "No run has Pass@k results (train with `pass_at_k.n=16` or more to get them)."]
    keys = (*EXPLORATION, *SPEED)
    lines += ["", "Exploration and speed, mean over each run's steps, then mean ± sd over runs:", ""]
    lines += ["| arm | " + " | ".join(k.split("/", 1)[1] for k in keys) + " |", "|---|" + "---:|" * len(keys)]
    for arm, info in tables["arms"].items():
        cells = [f"{m[0]:.3g} ± {m[1]:.2g}" if m else "" for m in (info["means"][k] for k in keys)]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", "Each arm's best run (final val/accuracy) and its checkpoint, for `ngrpo eval model=<checkpoint>`"]
    lines += ["or `ngrpo export <checkpoint> <folder>` (docs/checkpoints.md):", ""]
    lines += ["| arm | seed | final val/accuracy | checkpoint |", "|---|---|---:|---|"]
    for arm, (run, value, path) in best_checkpoints(runs).items():
        lines.append(f"| {arm} | {run.seed} | {value:.3f} | `{path}` |")
    return "\n".join(lines) + "\n"


def best_checkpoints(runs: list[RunData]) -> dict[str, tuple[RunData, float, str]]:
    """Per arm, the run with the best final ``val/accuracy`` and its checkpoint: ``best.ckpt`` if
    the run kept one, else ``last.ckpt`` (``not on this machine`` when its output_dir is elsewhere)."""
    final = lambda run: (run.curves.get("val/accuracy") or [(0, 0.0, math.nan)])[-1][2]  # noqa: E731
    out = {}
    for run in runs:
        best = out.get(run.arm)
        if best is None or (final(run) > best[1]) or math.isnan(best[1]):
            out[run.arm] = (run, final(run), "")
    for arm, (run, value, _) in out.items():
        folder = Path(str(run.params.get("output_dir", ""))) / "checkpoints"
        found = [folder / name for name in ("best.ckpt", "last.ckpt") if (folder / name).exists()]
        out[arm] = (run, value, str(found[0]) if found else f"{folder / 'last.ckpt'} (not on this machine)")
    return out


def _ci(value, signed: bool = False) -> str:
    if not value or math.isnan(value[0]):
        return ""
    mean, low, high = (100 * v for v in value)
    fmt = "{:+.1f}" if signed else "{:.1f}"
    return f"{fmt.format(mean)} [{fmt.format(low)}, {fmt.format(high)}]"


def plot_curves(runs: list[RunData], path, x: str = "step") -> None:
    """Learning curves of :data:`CURVES`, one colour per arm: the mean over seeds at each step and
    a band from the lowest to the highest seed; ``x="minutes"`` plots against wall time (each step
    at the mean time the arm's seeds reached it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in CURVES if any(k in r.curves for r in runs)]
    fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(4.2 * max(len(keys), 1), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for arm in sorted({r.arm for r in runs}):
            by_step: dict[int, list[tuple[float, float]]] = {}
            for r in runs:
                if r.arm == arm:
                    for step, minutes, value in r.curves.get(key, []):
                        by_step.setdefault(step, []).append((minutes, value))
            if not by_step:
                continue
            steps = sorted(by_step)
            xs = [np.mean([t for t, _ in by_step[s]]) for s in steps] if x == "minutes" else steps
            vals = [[v for _, v in by_step[s]] for s in steps]
            line = ax.plot(xs, [np.mean(v) for v in vals], label=arm, marker="." if len(steps) < 30 else None)
            ax.fill_between(xs, [min(v) for v in vals], [max(v) for v in vals], color=line[0].get_color(), alpha=0.2)
        ax.set_title(key)
        ax.set_xlabel("optimizer step" if x == "step" else "wall time (min)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_pass_at_k(tables: dict, path) -> None:
    """Final Pass@k against k per arm, with the bootstrap intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    ks = tables["ks"]
    for arm, info in tables["arms"].items():
        values = [info["final"][f"pass@{k}"] for k in ks]
        mean = [100 * v[0] for v in values]
        ax.errorbar(
            ks,
            mean,
            yerr=[[m - 100 * v[1] for m, v in zip(mean, values)], [100 * v[2] - m for m, v in zip(mean, values)]],
            marker="o",
            capsize=3,
            label=arm,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
