"""Markdown tables and PNG figures of the drift pilot and of the explorer comparison."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ngrpo_lightning.commands.diagnose.drift import pca_2d

METHOD_NAMES = {
    "gaussian": "Gaussian",
    "mixing": "neighbor mixing",
    "gaussian_matched": "Gaussian, norms matched to mixing",
}


def _figure(width: float, height: float):
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=90)


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# --------------------------------------------------------------------- drift
def drift_table(rows: list[dict], k: int) -> str:
    """One row per method and scale: displacement, decoding fractions, cosine, examples."""
    head = [
        "method",
        "‖δ‖/‖e‖",
        "→ original",
        f"→ {k}-neighborhood",
        "cos(p, e)",
        "cos(p, nearest token)",
        "examples (original -> decoded)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        name = f"Gaussian σ={r['scale']:g}" if r["method"] == "gaussian" else METHOD_NAMES[r["method"]]
        cells = [
            name,
            f"{r['rel_norm']:.3f}",
            f"{100 * r['same_frac']:.1f}%",
            f"{100 * r['neighborhood_frac']:.1f}%",
            f"{r['cosine']:.3f}",
            f"{r['nearest_cosine']:.3f}",
            _md_cell(", ".join(r["examples"][:3]) or "-"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_drift(result: dict, labels: list[str], path: str | os.PathLike, pca_key: str, title: str = "") -> Path:
    """Three panels: 2-D PCA of the original, mixed and noised points; the fractions decoding to the original (solid)
    and into the k-neighborhood (dashed) vs the relative displacement; the nearest token's cosine vs it."""
    fig = _figure(14, 4.6)
    ax, bx, cx = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
    pts = result["points"]
    original = pts["original"]
    series = [
        ("original", "original tokens", "k", "o"),
        ("mixing", "neighbor mixing", "tab:blue", "^"),
        ("gaussian_matched", "Gaussian, matched norm", "tab:orange", "s"),
        (pca_key, f"Gaussian σ={pca_key.split('@')[-1]}", "tab:red", "x"),
    ]
    xy0 = pca_2d(original, original)
    for key, name, color, marker in series:
        if key in pts:
            xy = pca_2d(pts[key], original)
            ax.scatter(xy[:, 0], xy[:, 1], s=14, c=color, marker=marker, alpha=0.75, label=name, linewidths=0.8)
            if key != "original":  # a faint line from each token to its perturbed point
                for a, b in zip(xy0.tolist(), xy.tolist()):
                    ax.plot([a[0], b[0]], [a[1], b[1]], color=color, alpha=0.15, linewidth=0.6)
    for (x, y), text in list(zip(xy0.tolist(), labels))[:40]:
        ax.annotate(
            text.strip() or repr(text), (x, y), fontsize=6, alpha=0.8, xytext=(2, 2), textcoords="offset points"
        )
    ax.set_title("PCA of the pilot tokens (axes of the originals)", fontsize=9)
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")
    ax.legend(fontsize=7, loc="best")

    rows = result["rows"]
    gauss = [r for r in rows if r["method"] == "gaussian"]
    points = [
        (m, c, r)
        for m, c in (("mixing", "tab:blue"), ("gaussian_matched", "tab:orange"))
        for r in rows
        if r["method"] == m
    ]
    x = [r["rel_norm"] for r in gauss]
    bx.plot(x, [100 * r["same_frac"] for r in gauss], "-o", color="tab:red", label="Gaussian grid")
    bx.plot(x, [100 * r["neighborhood_frac"] for r in gauss], "--o", color="tab:red", alpha=0.5)
    cx.plot(x, [r["nearest_cosine"] for r in gauss], "-o", color="tab:red", label="Gaussian grid")
    for method, color, r in points:
        bx.plot([r["rel_norm"]], [100 * r["same_frac"]], "*", ms=13, color=color, label=METHOD_NAMES[method])
        bx.plot([r["rel_norm"]], [100 * r["neighborhood_frac"]], "P", ms=8, color=color, alpha=0.6)
        cx.plot([r["rel_norm"]], [r["nearest_cosine"]], "*", ms=13, color=color, label=METHOD_NAMES[method])
    bx.set_ylim(-3, 103)
    bx.set_ylabel("decoded tokens (%)")
    bx.set_title("→ original (solid, ★)   → k-neighborhood (dashed, ✚)", fontsize=9)
    cx.set_ylim(0, 1.02)
    cx.set_ylabel("cosine to the nearest token")
    cx.set_title("how close the vector stays to some token", fontsize=9)
    for p in (bx, cx):
        p.set_xscale("log")
        p.set_xlabel("relative displacement ‖δ‖/‖e‖")
        p.grid(True, alpha=0.3)
        p.legend(fontsize=7, loc="lower left")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


# ------------------------------------------------------------------ rollouts
ROLLOUT_COLUMNS = (  # (metric key or None for mean@/pass@, header, format)
    ("mean", "Mean@{G}", "pct"),
    ("pass", "Pass@{G}", "pct"),
    ("distinct_answers", "distinct answers", "f2"),
    ("distinct_2gram", "distinct 2-gram", "f3"),
    ("distinct_4gram", "distinct 4-gram", "f3"),
    ("edit_distance", "edit distance (tokens)", "f1"),
    ("edit_distance_norm", "edit distance / length", "f3"),
    ("length", "length (tokens)", "f1"),
    ("truncated_frac", "cut at the limit", "pct"),
    ("mixed_frac", "mixed steps", "pct"),
)


def _key(col: str, G: int) -> str:
    return {"mean": f"mean@{G}", "pass": f"pass@{G}"}.get(col, col)


def rollouts_table(results: dict, G: int) -> str:
    """One row per explorer; the columns of :data:`ROLLOUT_COLUMNS`."""
    fmt = {
        "pct": lambda v: f"{100 * v:.1f}%",
        "f1": lambda v: f"{v:.1f}",
        "f2": lambda v: f"{v:.2f}",
        "f3": lambda v: f"{v:.3f}",
    }
    head = ["explorer"] + [h.format(G=G) for _, h, _ in ROLLOUT_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * len(ROLLOUT_COLUMNS) + "|"]
    for name, res in results.items():
        m = res["metrics"]
        lines.append("| " + " | ".join([name] + [fmt[f](m[_key(c, G)]) for c, _, f in ROLLOUT_COLUMNS]) + " |")
    return "\n".join(lines) + "\n"


def plot_rollouts(results: dict, G: int, path: str | os.PathLike, title: str = "") -> Path:
    """Bar charts, one panel per metric, one bar per explorer."""
    panels = [
        ("mean", f"Mean@{G} (%)", 100),
        ("pass", f"Pass@{G} (%)", 100),
        ("distinct_answers", "distinct answers per group", 1),
        ("distinct_4gram", "distinct 4-grams", 1),
        ("edit_distance_norm", "pairwise edit distance / length", 1),
        ("length", "response length (tokens)", 1),
    ]
    names = list(results)
    colors = [f"C{i}" for i in range(len(names))]
    fig = _figure(11, 5.8)
    for i, (col, label, factor) in enumerate(panels):
        ax = fig.add_subplot(2, 3, i + 1)
        values = [factor * results[n]["metrics"][_key(col, G)] for n in names]
        bars = ax.bar(range(len(names)), values, color=colors)
        ax.bar_label(bars, [f"{v:.1f}" if factor == 100 or v >= 10 else f"{v:.2f}" for v in values], fontsize=7)
        ax.set_xticks(range(len(names)), names, fontsize=8, rotation=20)
        ax.set_title(label, fontsize=9)
        ax.margins(y=0.15)
        ax.grid(True, axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def to_jsonable(obj):
    """Tensors in nested dicts/lists as lists (for the JSON files)."""
    if torch.is_tensor(obj):
        return obj.tolist()
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj
