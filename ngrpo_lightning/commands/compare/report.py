"""The comparison report: verdicts first, then what the sweep detects, per-arm tables (final Pass@k with intervals
over seeds, posterior Pass@k, exploration, speed), the curve fits, and figures (learning curves, Pass@k)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np

from ngrpo_lightning.commands.compare.curves import AXES, arm_fits, contrast
from ngrpo_lightning.commands.compare.posterior import (
    fit_hierarchical_prior,
    per_problem_counts,
    posterior_interval,
    ranking_changes,
)
from ngrpo_lightning.commands.compare.power import (
    detection,
    holm,
    joint_bound,
    plan_text,
    seeds_to_conclude,
    verdict,
)
from ngrpo_lightning.commands.compare.runs import CURVES, EXPLORATION, SPEED, RunData, code_versions
from ngrpo_lightning.commands.compare.sequential import steadiness, verdict_history
from ngrpo_lightning.commands.compare.stats import paired_differences, per_problem_scores, seed_interval, seed_order


def arm_tables(runs: list[RunData], cfg) -> dict:
    """Everything the report shows, as plain data (also written as JSON). ``cfg`` gives ``level``,
    ``power``, ``detect`` (the difference a plan aims at), ``draws``, ``resamples`` and ``seed``."""
    arms = sorted({r.arm for r in runs})
    by_arm = {a: [r for r in runs if r.arm == a] for a in arms}
    out = {"arms": {}, "paired": [], "ks": [], "detect": float(cfg.detect)}
    ns = {p["n"] for r in runs if r.pass_at_k for s in r.pass_at_k["sets"].values() for p in s["problems"]}
    n = min(ns) if ns else 0
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, n) if 1 <= k <= n})
    out["ks"], out["n"] = ks, n
    scores = {}  # arm -> seed -> {problem: {metric: value}}
    prior = fit_hierarchical_prior([c for r in runs if r.pass_at_k for c in per_problem_counts(r.pass_at_k)])
    out["prior"] = prior.typical()
    for arm, members in by_arm.items():
        info = {
            "runs": [r.run_id for r in members],
            "seeds": sorted((r.seed for r in members), key=seed_order),
            "final": {},
        }
        per_seed = {r.seed: _all_scores(r, ks) for r in members if r.pass_at_k}
        scores[arm] = per_seed
        metrics = [f"pass@{k}" for k in ks] + ([f"mean@{n}", f"maj@{n}"] if n else [])
        for m in metrics:
            groups = [[v[m] for v in per_seed[s].values()] for s in sorted(per_seed)]
            info["final"][m] = list(seed_interval(groups, cfg.level, bounds=(0.0, 1.0)))  # rates
        counts = [per_problem_counts(r.pass_at_k) for r in members if r.pass_at_k]
        info["posterior"] = {
            f"pass@{k}": list(posterior_interval(counts, k, cfg.draws, cfg.seed, prior=prior)) for k in ks
        }
        info["problems"] = sum(len(v) for v in per_seed.values())
        info["per_seed"] = {
            seed: {m: float(np.mean([v[m] for v in values.values()])) for m in metrics}
            for seed, values in per_seed.items()
        }
        for key in (*EXPLORATION, *SPEED):
            values = [_run_mean(r, key) for r in members]
            values = [v for v in values if not math.isnan(v)]
            info.setdefault("means", {})[key] = (float(np.mean(values)), float(np.std(values))) if values else None
        out["arms"][arm] = info
    found_all = []
    for a, b in itertools.combinations(arms, 2):
        for m in [f"pass@{k}" for k in sorted({ks[0], ks[-1]})] if ks else []:
            found = detection(paired_differences(scores[a], scores[b], m), cfg.level, cfg.power)
            found_all.append(found)
            history = verdict_history(scores[a], scores[b], m, cfg.detect, cfg.level, cfg.power)
            out["paired"].append(
                {
                    "a": a,
                    "b": b,
                    "metric": m,
                    "pairs": sum(len(scores[a][s]) for s in set(scores[a]) & set(scores[b])),
                    "detection": found.as_dict(),
                    "verdict": verdict(a, b, found, cfg.detect),
                    "plan": plan_text(found, cfg.detect),
                    "to_conclude": seeds_to_conclude(found, cfg.detect),
                    "history": history,
                    "steadiness": steadiness(history),
                }
            )
    # read together only where each verdict bounds something (not inconclusive, not without spread)
    bounded = [f for f, p in zip(found_all, out["paired"]) if p["verdict"]["kind"] == "bounded"]
    out["joint_bound"] = joint_bound(bounded) if len(bounded) > 1 else float("nan")
    out["joint_count"] = len(bounded)
    adjusted = holm([p["detection"]["p_value"] for p in out["paired"]])
    alpha = 1 - cfg.level
    for p, p_holm in zip(out["paired"], adjusted):
        p["p_holm"] = p_holm
        if p["verdict"]["kind"] == "greater" and not p_holm <= alpha:
            p["verdict"]["text"] += (
                f"; not after Holm's correction for the {len(adjusted)} comparisons of this report (p = {p_holm:.2g})"
            )
            p["verdict"]["kind"] = "greater, uncorrected"
    out["ranking_changes"] = {}
    for k in ks:
        unbiased = {a: out["arms"][a]["final"][f"pass@{k}"][0] for a in arms}
        posterior = {a: out["arms"][a]["posterior"][f"pass@{k}"][0] for a in arms}
        if changed := ranking_changes(unbiased, posterior):
            out["ranking_changes"][f"pass@{k}"] = changed
    out["fits"] = arm_fits(runs, n_boot=cfg.resamples, seed=cfg.seed)
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
    """The report as markdown: the verdicts first, then the plan, the tables and the fits."""
    ks, n, target = tables["ks"], tables["n"], 100 * tables["detect"]
    lines = [header, ""]
    left_out = [w for w in warnings if w.startswith("left out:")]
    differ = [w for w in warnings if not w.startswith("left out:")]
    if differ:
        lines += ["**Not comparable as they stand** (the runs differ; the verdicts below mix them):", ""]
        lines += [f"- {w}" for w in differ] + [""]
    if left_out:
        lines += ["**Runs left out**:", ""] + [f"- {w.removeprefix('left out: ')}" for w in left_out] + [""]
    if paired := tables["paired"]:
        lines += ["## Verdicts", ""]
        lines += [f"- **{p['metric'].capitalize()}**, {p['a']} vs {p['b']}: {p['verdict']['text']}" for p in paired]
        lines += ["", "Differences in percentage points with their 95% t interval over seeds (the runs' paired"]
        lines += [
            f'problems averaged per seed); "no difference larger than X" needs the interval inside ±{target:.1f}.'
        ]
        lines += ["A difference is also checked with Holm's correction over all the comparisons listed, which"]
        lines += ["keeps the chance of any false difference among them at 5%."]
        joint, count = tables["joint_bound"], tables.get("joint_count", len(paired))
        if count > 1 and not math.isnan(joint):
            which = f"all {count}" if count == len(paired) else f"the {count} that bound a difference"
            lines += [
                f"Read together ({which} intervals at once, Bonferroni: 95% jointly), no difference among them",
                f"is larger than {100 * joint:.1f} points.",
            ]
        lines += ["", f"## What this sweep can detect, and what {target:.1f} points would take", ""]
        lines += [
            "| a | b | metric | seeds | problems / seed | a - b | detects (80% power) | to detect "
            f"{target:.1f} points | at the estimate, seeds to bound within {target:.1f} / to show it |",
            "|---|---|---|---:|---:|---:|---:|---|---:|",
        ]
        for p in paired:
            d = p["detection"]
            diff = _ci((d["diff"], d["low"], d["high"]), signed=True)
            mdd = f"{100 * d['mdd']:.1f}" if not math.isnan(d["mdd"]) else ""
            design = f"{d['seeds']} | {d['problems']:.0f}"
            bound, show = p["to_conclude"]
            conclude = f"{bound or 'never'} / {show or 'never'}" if d["se"] > 0 else "no spread to project with"
            lines.append(
                f"| {p['a']} | {p['b']} | {p['metric']} | {design} | {diff} | {mdd} | {p['plan']} | {conclude} |"
            )
        lines += [
            "",
            "The last column assumes the difference stays at today's estimate (it moves as seeds come in):",
            "the seeds whose interval would lie within the target, and those whose interval would exclude 0.",
            "`ngrpo compare ... detect=0.03` plans for another difference (a fraction: 0.03 = 3 points).",
        ]
        lines += _history_lines(paired)
    lines += ["", "## Arms", "", "| arm | seeds | runs | problems (x seeds) |", "|---|---|---:|---:|"]
    for arm, info in tables["arms"].items():
        lines.append(f"| {arm} | {', '.join(info['seeds'])} | {len(info['runs'])} | {info['problems']} |")
    lines += ["", code_versions(runs)]
    if ks:
        metrics = [f"pass@{k}" for k in ks] + [f"mean@{n}", f"maj@{n}"]
        lines += ["", f"Final evaluation (n = {n} samples per problem), %: mean [95% t interval over seeds]:", ""]
        lines += ["| arm | " + " | ".join(m.capitalize() for m in metrics) + " |", "|---|" + "---:|" * len(metrics)]
        for arm, info in tables["arms"].items():
            cells = [_ci(info["final"].get(m)) for m in metrics]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        first, last = f"pass@{ks[0]}", f"pass@{ks[-1]}"
        lines += ["", f"Per seed, %: {first.capitalize()} / {last.capitalize()} (the spread the intervals carry):", ""]
        seeds = sorted({s for info in tables["arms"].values() for s in info["per_seed"]}, key=seed_order)
        arms = list(tables["arms"])  # a row per seed: a sweep has more seeds than arms
        lines += ["| seed | " + " | ".join(arms) + " |", "|---|" + "---:|" * len(arms)]
        for s in seeds:
            cells = [
                f"{100 * per_seed[s][first]:.1f} / {100 * per_seed[s][last]:.1f}" if s in per_seed else ""
                for per_seed in (tables["arms"][arm]["per_seed"] for arm in arms)
            ]
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        a, b = tables["prior"]
        lines += [
            "",
            "Posterior Pass@k, %: posterior mean [95% credible interval]; each problem's success rate with the",
        ]
        lines += [
            f"problems' rates drawn from a Beta fitted to every run here, itself uncertain (typically Beta({a:.2f}, "
            f"{b:.2f}): a hierarchical model). The interval is the uncertainty of these runs' problems given their",
            "samples; the spread between seeds, which a ranking must survive, is in the t intervals above:",
            "",
        ]
        lines += ["| arm | " + " | ".join(f"Pass@{k}" for k in ks) + " |", "|---|" + "---:|" * len(ks)]
        for arm, info in tables["arms"].items():
            lines.append(f"| {arm} | " + " | ".join(_ci(info["posterior"][f"pass@{k}"]) for k in ks) + " |")
        changes = tables["ranking_changes"]
        lines += [""]
        lines += [
            f"- at {m.capitalize()} the unbiased estimator ranks {a} above {b}, the posterior {b} above {a}"
            for m, pairs in changes.items()
            for a, b in pairs
        ] or ["The posterior ranks the arms as the unbiased estimator does at every k."]
    else:
        lines += ["", "No run has Pass@k results (train with `pass_at_k.n=16` or more to get them)."]
    lines += _fit_lines(tables["fits"])
    keys = (*EXPLORATION, *SPEED)
    lines += ["", "## Exploration and speed", "", "Mean over each run's steps, then mean ± sd over runs:", ""]
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


def _history_lines(paired: list[dict]) -> list[str]:
    """How each verdict moved as the seeds came in (figure: seeds.png)."""
    if not any(p["history"] for p in paired):
        return []
    lines = ["", "## How the verdicts moved with the seeds", ""]
    lines += ["Each verdict on the first 2, 3, ... seeds in seed order, at its own 95% level (figure: seeds.png).", ""]
    lines += ["| a | b | metric | verdict now | held since (seeds) | changes |", "|---|---|---|---|---:|---:|"]
    for p in paired:
        steady = p["steadiness"]
        if steady["held_since"] is None:
            continue
        now = p["verdict"]["kind"]
        if "winner" in p["verdict"]:
            now = f"{p['verdict']['winner']} ahead" + (", uncorrected" if now != "greater" else "")
        lines.append(f"| {p['a']} | {p['b']} | {p['metric']} | {now} | {steady['held_since']} | {steady['changes']} |")
    lines += [
        "",
        "A verdict read after every new seed, the sweep stopped at the first that looks settled, is wrong more",
        "often than its level says; fix the seeds before looking (the plan above) and read the verdict there.",
        "One that held only since the last seed or two may turn with the next.",
    ]
    return lines


def _fit_lines(fits: dict) -> list[str]:
    """The curve fits per axis, and what they tell apart for each pair of arms."""
    if not any(f for per_arm in fits.values() for f in per_arm.values()):
        return [
            "",
            "## Curves against compute",
            "",
            "Too few validations per run to fit a curve (set trainer.val_check_interval).",
        ]
    lines = ["", "## Curves against compute", ""]
    lines += ["val/accuracy fitted per arm with R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) (figure: compute.png);"]
    lines += ["[95% interval, seeds resampled]. A ceiling counts as reached only when C_mid lies within the runs.", ""]
    lines += [
        "| compute | arm | R0 | asymptote A | midpoint C_mid | slope B | rmse |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for axis, per_arm in fits.items():
        for arm, f in per_arm.items():
            if f is None:
                lines.append(f"| {AXES[axis]} | {arm} | | no fit: too few points, or no change | | | |")
                continue
            ceiling = _cell(f, "asymptote", "{:.3f}") + ("" if f.ceiling_identified else " (not reached)")
            lines.append(
                f"| {AXES[axis]} | {arm} | {f.r0:.3f} | {ceiling} | {_cell(f, 'midpoint', '{:.3g}')} | "
                f"{_cell(f, 'slope', '{:.2f}')} | {f.rmse:.3f} |"
            )
    lines += [""]
    for axis, per_arm in fits.items():
        for a, b in itertools.combinations(sorted(per_arm), 2):
            lines.append(f"- {AXES[axis]}, {a} vs {b}: {contrast(a, b, per_arm[a], per_arm[b], axis)}")
    return lines


def _cell(fit, param: str, fmt: str) -> str:
    value = fmt.format(getattr(fit, param))
    if param not in fit.intervals:
        return value
    low, high = fit.intervals[param]
    return f"{value} [{fmt.format(low)}, {fmt.format(high)}]"


def best_checkpoints(runs: list[RunData]) -> dict[str, tuple[RunData, float, str]]:
    """Per arm, the run with the best final ``val/accuracy`` and its ``best.ckpt`` or ``last.ckpt``."""
    final = lambda run: (run.curves.get("val/accuracy") or [(0, 0.0, math.nan)])[-1][2]  # noqa: E731
    out = {}
    for run in runs:
        best = out.get(run.arm)
        if best is None or (final(run) > best[1]) or math.isnan(best[1]):
            out[run.arm] = (run, final(run), "")
    for arm, (run, value, _) in out.items():
        folder = Path(str(run.params.get("output_dir", ""))) / "checkpoints"
        found = [folder / name for name in ("best.ckpt", "last.ckpt") if (folder / name).exists()]
        if found:
            where = str(found[0])
        elif str(run.params.get("trainer.enable_checkpointing", "True")).lower() == "false":
            where = "none: the run kept no checkpoint (trainer.enable_checkpointing=false)"
        else:
            where = f"{folder / 'last.ckpt'} (not on this machine)"
        out[arm] = (run, value, where)
    return out


def _ci(value, signed: bool = False) -> str:
    if not value or math.isnan(value[0]):
        return ""
    mean, low, high = (100 * v for v in value)
    fmt = "{:+.1f}" if signed else "{:.1f}"
    return f"{fmt.format(mean)} [{fmt.format(low)}, {fmt.format(high)}]"


def plot_curves(runs: list[RunData], path, x: str = "step") -> None:
    """Learning curves of :data:`CURVES`, a colour per arm: seed mean, min-max band; ``x="minutes"``: vs wall time."""
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
    """Final Pass@k against k per arm, with the t intervals over seeds (inside 0-100%)."""
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
