"""The across-lengths report of ``benchmarks/vs_trl.py --tokens 40 256 1024``: the table's
columns, the floor with decoding's memory reads (``roofline_s``), and the plot of seconds per
step (with the floors) and step / floor against response length for every side.

Run on a saved result, it prints the table and redraws the plot again, adding the roofline
to a result from before it existed (the bandwidth then measured now, on this machine):

    .venv/bin/python benchmarks/vs_trl_lengths.py benchmarks/results/vs_trl_lengths.json \\
        --plot docs/images/vs_trl_lengths.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

from compute_floor import ModelShape, model_shape, read_bandwidth, step_roofline_s

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
    "roofline_s",
    "x_roofline",
    "attn_share",
    "cmd_rss_gib",
    "tree_rss_gib",
]


def add_roofline(rows: list[dict], shape: ModelShape, rate: float, bandwidth: float, dtype: str, frozen: bool) -> None:
    """Each row's ``roofline_s`` and ``x_roofline`` (medians over its steps; ``None`` at natural
    lengths): the floor with decoding's reads of the weights and the KV cache, see
    ``compute_floor.step_roofline_s``."""
    value_bytes = 2 if dtype in ("bfloat16", "float16") else 4
    for row in rows:
        steps = row.get("per_step") or []
        floors = [step_roofline_s(s, shape, rate, bandwidth, value_bytes, frozen=frozen) for s in steps]
        known = steps and None not in floors
        row["roofline_s"] = statistics.median(floors) if known else None
        ratios = [s["step_s"] / f for s, f in zip(steps, floors)] if known else []
        row["x_roofline"] = statistics.median(ratios) if ratios else None


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
        line = left.plot(x, [r["s/step"] for r in mine], "o-", label=side)[0]
        right.plot(x, [r["x_floor"] for r in mine], "o-", color=line.get_color(), label=f"{side} / compute floor")
        if all(r.get("x_roofline") for r in mine):
            roof = [r["x_roofline"] for r in mine]
            right.plot(x, roof, "s:", color=line.get_color(), label=f"{side} / floor with decoding's reads")
    first = [r for r in rows if r["side"] == rows[0]["side"]]
    left.plot([r["max_new_tokens"] for r in first], [r["floor_s"] for r in first], "k--", label="compute floor")
    if all(r.get("roofline_s") for r in first):
        roofline = [r["roofline_s"] for r in first]
        left.plot([r["max_new_tokens"] for r in first], roofline, "k:", label="floor with decoding's reads")
    left.set(xscale="log", yscale="log", xlabel="response length (max new tokens)", ylabel="s / step")
    right.set(xscale="log", xlabel="response length (max new tokens)", ylabel="step / floor", ylim=(0, None))
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


def main(argv=None) -> None:
    """Print a saved across-lengths result's table, with the roofline, and redraw its plot."""
    from common import print_table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="the JSON vs_trl.py --tokens ... wrote")
    ap.add_argument("--plot", help="where to draw the plot (default: next to the result)")
    args = ap.parse_args(argv)
    saved = json.loads(Path(args.result).read_text())
    meta, rows = saved["meta"], saved["rows"]
    if "read_gbps" not in meta:
        meta["read_gbps"] = read_bandwidth() / 1e9
        print(f"read bandwidth measured now: {meta['read_gbps']:.1f} GB/s")
    workload = meta["workload"]
    shape = ModelShape(**meta["model_shape"])
    if not shape.kv_width:  # a result from before the roofline: the shape again, from the model's config
        from ngrpo_lightning.models.loading import resolve_model_path

        shape = model_shape(resolve_model_path(workload["model"]))
        meta["model_shape"] = asdict(shape)
    rate, frozen = meta["matmul_gflops"] * 1e9, workload.get("lora_rank", 0) > 0
    add_roofline(rows, shape, rate, meta["read_gbps"] * 1e9, workload["dtype"], frozen)
    print_table(rows, LENGTH_COLUMNS)
    kind = "natural lengths, at most" if workload["natural"] else "fixed lengths,"
    title = f"{workload['prompts']} prompts x {workload['group']} completions, {kind} the given tokens"
    title += f"; {workload['dtype']}, {workload['threads']} threads"
    print(f"\nplotted {plot_lengths(rows, args.plot or Path(args.result).with_suffix('.png'), title)}")
    Path(args.result).write_text(json.dumps(saved, indent=2))


if __name__ == "__main__":
    main()
