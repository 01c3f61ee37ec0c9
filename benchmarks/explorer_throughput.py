"""Explorer overhead: rollout tokens/s of every explorer relative to plain sampling, and the
cost of the neighbor index (build, per-step retrieval, cached lookup) on a large vocabulary.

    python benchmarks/explorer_throughput.py                        # the full run (minutes on a CPU)
    python benchmarks/explorer_throughput.py --batch-sizes 8 --new-tokens 32 --repeats 1 --index-vocab 20000

Rollouts: HFEngine on the packaged model with EOS ignored, so every explorer decodes exactly
batch x new_tokens tokens. Throughput is reported per wall-clock second and per CPU second of
this process (steadier on a shared machine; pin --threads 1 there). ``neighbor`` reuses one
explorer for every rollout, as training does (the static index and its per-anchor cache
persist; one untimed full-length rollout warms it); ``neighbor-cold`` builds a fresh explorer
for every rollout (index built and every anchor searched inside the timed rollout, as in the
first training step). Explorers run round-robin within a repeat so that load drifts hit them
alike; the median over repeats is reported.
Target: neighbor mixing >= 0.95x plain sampling.

Index: a random V x d matrix (default 152064 x 1536, a Qwen2.5-1.5B-sized vocabulary).
Prints tables and writes JSON to benchmarks/results/ (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from ngrpo_lightning.explorers import (
    GaussianNoiseExplorer,
    GumbelSoftExplorer,
    NeighborIndex,
    NeighborMixingExplorer,
    TemperatureExplorer,
)

EXPLORERS = {
    "temperature": lambda: TemperatureExplorer(temperature=1.0),
    "neighbor": lambda: NeighborMixingExplorer(k=3, rho=0.1),  # paper defaults; reused, as in training
    "neighbor-cold": lambda: NeighborMixingExplorer(k=3, rho=0.1),  # a fresh index every rollout
    "neighbor-rho1": lambda: NeighborMixingExplorer(k=3, rho=1.0),  # "w/o rate": every step mixed
    "gaussian": lambda: GaussianNoiseExplorer(sigma=0.5, rho=1.0),
    "gumbel": lambda: GumbelSoftExplorer(top_k=5, tau=0.5),
}
QUESTIONS = [
    "What is 7 + 5?",
    "What is 3 * 4?",
    "What is 12 - 9?",
    "What is 81 / 9?",
    "What is 15 + 27?",
    "What is 6 * 7?",
    "What is 100 - 37?",
    "What is 2 ** 5?",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="model name or path (default: the packaged SmolLM2)"
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--explorers", nargs="+", default=list(EXPLORERS), choices=list(EXPLORERS))
    p.add_argument(
        "--index-vocab", type=int, default=152064, help="rows of the random matrix (0 = skip the index benchmark)"
    )
    p.add_argument("--index-dim", type=int, default=1536)
    p.add_argument("--index-metrics", nargs="+", default=["cosine", "l2", "l1"])
    p.add_argument(
        "--precompute-sample", type=int, default=256, help="anchors searched to extrapolate a full precompute"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--skip-rollouts", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "explorer_throughput.json"))
    return p.parse_args(argv)


# ---------------------------------------------------------------- rollouts
def bench_rollouts(args) -> list[dict]:
    from ngrpo_lightning.data import render_prompt
    from ngrpo_lightning.models.loading import load_policy
    from ngrpo_lightning.rollout import HFEngine

    model, tok = load_policy(args.model, dtype=args.dtype)
    rows = []
    for batch in args.batch_sizes:
        prompts = [
            tok(render_prompt(tok, QUESTIONS[i % len(QUESTIONS)]), add_special_tokens=False)["input_ids"]
            for i in range(batch)
        ]
        # ignore_eos: decode exactly batch x new_tokens for every explorer
        engine = HFEngine(model, tok, max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
        persistent = {name: EXPLORERS[name]() for name in args.explorers if name != "neighbor-cold"}
        for name in args.explorers:  # warm-up: kernels, allocator
            engine.generate(prompts, EXPLORERS[name](), max_new_tokens=4)
        if "neighbor" in persistent:  # the steady state of training: a cache filled by earlier rollouts
            engine.generate(prompts, persistent["neighbor"])
        runs = {name: [] for name in args.explorers}
        cpu_runs = {name: [] for name in args.explorers}
        mixed = {}
        for r in range(args.repeats):
            for name in args.explorers:
                cpu0 = time.process_time()
                explorer = persistent[name] if name in persistent else EXPLORERS[name]()
                out = engine.generate(prompts, explorer)
                tokens = int(out.response_mask.sum())
                runs[name].append(out.stats["rollout/tokens_per_s"])
                cpu_runs[name].append(tokens / max(time.process_time() - cpu0, 1e-9))
                mixed[name] = len(out.records) / max(tokens, 1)
                print(
                    f"  batch {batch:>3} repeat {r + 1}/{args.repeats} {name:<14} {runs[name][-1]:8.1f} tok/s "
                    f"{cpu_runs[name][-1]:8.1f} tok/cpu-s",
                    flush=True,
                )
        base = statistics.median(runs["temperature"]) if "temperature" in runs else None
        cpu_base = statistics.median(cpu_runs["temperature"]) if "temperature" in runs else None
        for name, tps in runs.items():
            med, cpu = statistics.median(tps), statistics.median(cpu_runs[name])
            rows.append(
                {
                    "batch": batch,
                    "explorer": name,
                    "tokens_per_s": med,
                    "runs": tps,
                    "mixed_frac": mixed[name],
                    "relative": med / base if base else None,
                    "tokens_per_cpu_s": cpu,
                    "cpu_runs": cpu_runs[name],
                    "relative_cpu": cpu / cpu_base if cpu_base else None,
                }
            )
    return rows


# ------------------------------------------------------------------- index
def timed(fn, repeats=3):
    """Median seconds of ``fn()`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_index(args) -> list[dict]:
    v, d = args.index_vocab, args.index_dim
    emb = torch.randn(v, d, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    rows = []
    for metric in args.index_metrics:
        reps = 1 if metric == "l1" else 3  # l1 has no matmul form: much slower
        build = timed(lambda: NeighborIndex(emb, 2, metric), reps)
        index = NeighborIndex(emb, 2, metric)
        row = {"metric": metric, "vocab": v, "dim": d, "build_s": build}
        for b in args.batch_sizes:
            anchors = [torch.randint(0, v, (b,), generator=gen) for _ in range(reps)]
            it = iter(anchors)
            row[f"search_b{b}_s"] = timed(lambda: index.search(next(it)), reps)  # uncached: a full pass over V
            index.query(anchors[0])
            row[f"cached_b{b}_s"] = timed(lambda: index.query(anchors[0]), 20)  # every anchor cached
        if metric == "cosine" and args.precompute_sample:
            sample = torch.arange(args.precompute_sample)
            per_anchor = timed(lambda: index.search(sample), 1) / len(sample)
            row["precompute_est_s"] = per_anchor * v
        rows.append(row)
        print(f"  index {metric}: {row}", flush=True)
    return rows


# ------------------------------------------------------------------ report
def report(rollouts, index, args) -> str:
    lines = []
    if rollouts:
        lines += [
            f"Rollout throughput ({args.model}, {args.dtype}, {args.new_tokens} new tokens, EOS ignored, "
            f"median of {args.repeats}, torch threads {torch.get_num_threads()})",
            f"{'batch':>5}  {'explorer':<14} {'tok/s':>8} {'relative':>9}  "
            f"{'tok/cpu-s':>9} {'relative':>9}  {'mixed frac':>10}",
        ]
        for r in rollouts:
            rel = f"{r['relative']:.3f}x" if r["relative"] else "-"
            rel_cpu = f"{r['relative_cpu']:.3f}x" if r["relative_cpu"] else "-"
            lines.append(
                f"{r['batch']:>5}  {r['explorer']:<14} {r['tokens_per_s']:8.1f} {rel:>9}  {r['tokens_per_cpu_s']:9.1f} "
                f"{rel_cpu:>9}  {r['mixed_frac']:10.3f}"
            )
    if index:
        v, d = index[0]["vocab"], index[0]["dim"]
        lines += ["", f"Neighbor index on a random {v} x {d} fp32 matrix (k=3: 2 neighbors; times in ms)"]
        head = f"{'metric':<7} {'build':>8}" + "".join(
            f" {'search B=' + str(b):>13} {'cached B=' + str(b):>13}" for b in args.batch_sizes
        )
        lines += [head + f" {'full precompute (est.)':>23}"]
        for r in index:
            cells = "".join(
                f" {1e3 * r[f'search_b{b}_s']:13.1f} {1e3 * r[f'cached_b{b}_s']:13.3f}" for b in args.batch_sizes
            )
            pre = f"{r['precompute_est_s']:.0f} s" if "precompute_est_s" in r else "-"
            lines.append(f"{r['metric']:<7} {1e3 * r['build_s']:8.1f}{cells} {pre:>23}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rollouts = [] if args.skip_rollouts else bench_rollouts(args)
    index = bench_index(args) if args.index_vocab else []
    text = report(rollouts, index, args)
    print("\n" + text)
    result = {
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "rollouts": rollouts,
        "index": index,
        "table": text,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
