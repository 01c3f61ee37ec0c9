"""The across-lengths report of ``benchmarks/vs_trl.py --tokens 40 256 1024``: the table's
columns and the plot of seconds per step (with the compute floor) and step / floor against
response length for every side."""

from __future__ import annotations

from pathlib import Path

LENGTH_COLUMNS = [
    "max_new_tokens",
    "micro_batch",
    "side",
    "tokens",
    "s/step",
    "vs_ours",
    "gen_s",
    "update_s",
    "floor_s",
    "x_floor",
    "attn_share",
    "cmd_rss_gib",
    "tree_rss_gib",
]


def plot_lengths(rows: list[dict], path: str | Path, title: str) -> Path:
    """Seconds per step against response length for each side, with the compute floor (left),
    and each side's step / floor (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for side in dict.fromkeys(r["side"] for r in rows):
        mine = sorted((r for r in rows if r["side"] == side), key=lambda r: r["max_new_tokens"])
        x = [r["max_new_tokens"] for r in mine]
        left.plot(x, [r["s/step"] for r in mine], "o-", label=side)
        right.plot(x, [r["x_floor"] for r in mine], "o-", label=side)
    floor = {r["max_new_tokens"]: r["floor_s"] for r in rows if r["side"] == rows[0]["side"]}
    left.plot(list(floor), list(floor.values()), "k--", label="compute floor (prompts shared)")
    left.set(xscale="log", yscale="log", xlabel="response length (max new tokens)", ylabel="s / step")
    right.set(xscale="log", xlabel="response length (max new tokens)", ylabel="step / compute floor", ylim=(0, None))
    micro = {r["max_new_tokens"]: r.get("micro_batch", 0) for r in rows}
    lengths = sorted(micro)
    labels = [f"{n}\n{micro[n] or 'all'} rows/micro-batch" if len(set(micro.values())) > 1 else str(n) for n in lengths]
    for ax in (left, right):
        ax.set_xticks(lengths, labels)
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
