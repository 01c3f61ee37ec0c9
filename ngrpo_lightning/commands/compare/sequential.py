"""How a sweep's verdicts moved as its seeds came in: each pair's difference and interval on its
first 2, 3, ... seeds (in seed order), and since when the verdict it gives now has held.

A verdict read after every new seed, stopping at the first that looks settled, is wrong far more often than its level
says (optional stopping; simulated in tests/test_compare_power.py). Fix the number of seeds first (the report's plan
says how many) and read the verdict there; the history shows whether it held or is one seed from turning."""

from __future__ import annotations

from ngrpo_lightning.commands.compare.power import detection, verdict_kind
from ngrpo_lightning.commands.compare.stats import paired_differences


def verdict_history(
    a: dict[str, dict], b: dict[str, dict], metric: str, target: float, level: float = 0.95, power: float = 0.8
) -> list[dict]:
    """The verdict on ``a - b`` (:func:`~.power.verdict`'s kind) on the first 2, 3, ... seeds both arms have: one
    ``{"seeds", "diff", "low", "high", "kind"}`` per count. ``a``, ``b``: as for :func:`~.stats.paired_differences`."""
    groups = paired_differences(a, b, metric)  # one list per seed, in seed order
    out = []
    for count in range(2, len(groups) + 1):
        found = detection(groups[:count], level, power)
        kind = verdict_kind(found, target)
        out.append({"seeds": count, "diff": found.diff, "low": found.low, "high": found.high, "kind": kind})
    return out


def steadiness(history: list[dict]) -> dict:
    """``{"held_since", "changes"}``: the fewest seeds since which the verdict has been what it is now,
    and how often it changed (``held_since`` None for fewer than 2 seeds)."""
    if not history:
        return {"held_since": None, "changes": 0}
    kinds = [_kind(h) for h in history]
    changes = sum(1 for x, y in zip(kinds, kinds[1:]) if x != y)
    held = len(kinds) - 1
    while held > 0 and kinds[held - 1] == kinds[-1]:
        held -= 1
    return {"held_since": history[held]["seeds"], "changes": changes}


def _kind(entry: dict) -> str:
    if entry["kind"] == "greater":
        return "a > b" if entry["low"] > 0 else "b > a"
    return entry["kind"]


def plot_history(paired: list[dict], target: float, path) -> None:
    """One panel per pair and metric: the difference against the seeds, its 95% interval as a band,
    0 and +-``target`` as lines, the verdict's kind as colour; the axis spans 3 x ``target`` or more."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = list(dict.fromkeys((p["a"], p["b"]) for p in paired))  # in the report's order
    metrics = list(dict.fromkeys(p["metric"] for p in paired))
    fig, axes = plt.subplots(
        len(pairs), len(metrics), figsize=(4.4 * len(metrics), 2.6 * len(pairs)), squeeze=False, sharex=True
    )
    colours = {"greater": "tab:red", "bounded": "tab:green", "inconclusive": "tab:grey"}
    for p in paired:
        ax = axes[pairs.index((p["a"], p["b"]))][metrics.index(p["metric"])]
        history = p["history"]
        if not history:
            continue
        xs = [h["seeds"] for h in history]
        ax.fill_between(xs, [100 * h["low"] for h in history], [100 * h["high"] for h in history], alpha=0.2)
        diffs = [100 * h["diff"] for h in history]
        ax.plot(xs, diffs, color="tab:blue", lw=1)
        ax.scatter(xs, diffs, c=[colours.get(h["kind"], "k") for h in history], s=12, zorder=3)
        for y, style in ((0, "-"), (100 * target, "--"), (-100 * target, "--")):
            ax.axhline(y, color="k", lw=0.6, ls=style)
        reach = max(3 * 100 * target, 1.5 * max(abs(d) for d in diffs))  # two seeds' intervals would flatten the rest
        ax.set_ylim(-reach, reach)
        ax.set_title(f"{p['metric']}: {p['a']} - {p['b']}", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("seeds")
    for row in axes:
        row[0].set_ylabel("difference (points)")
    handles = [plt.Line2D([], [], ls="", marker="o", color=c, label=k) for k, c in colours.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
