"""``harness.py floor``: the workload's step against its compute floor, both measured in one run.

Each mode (full fine-tuning, LoRA) runs the workload's ``ngrpo train`` in a process of its own
(``side_ours.py``); the device's dense matmul rate and, on a CPU, its read bandwidth are measured
here before and after the runs (the better of the two counts). A step's floor is the matmul FLOPs
its passes need (``compute_floor.step_flops``) at that rate: ``x_floor`` is step / floor, and
``logprobs_x_floor`` / ``update_x_floor`` the same for the reference pass and the update.
``gen_x_floor`` is generation over its decoding steps' bandwidth floor (each step reads every
weight once and every row's keys and values so far), ``decode_ms`` generation's time per token of
a row. On a CPU the roofline joins the two at a decoding step's rows: each step's products at the
rate this machine multiplies that few rows (``decode_products_ms``: the model's linear shapes timed
at those rows, the faster way, weights warm in the caches) or its weights' read, whichever is
longer, plus its keys' and values' read; the prefill at the dense rate. ``gen_x_roofline`` is
generation over it, ``x_roofline`` the step over the roofline with the passes at their floor.
``gen_x_streamed`` is generation over the same sum with each step's products as a step runs them
(``decode_products_streamed_ms``: every product on a weight of its own, in order, each weight read
from memory): how much of generation is its products, and how much everything else.
``products_x_floor`` (``--profile``, on a CPU): the profiled step's linear products alone, their own
time as they ran in place (``step_profile.py``), over the step's floor: how far the products'
rates keep the step from its floor were everything else free.
The first step of every run is its warm-up: left out of the medians, its excess over the
median step is ``warmup_s``, split by phase (``warmup_gen_s``, ...); ``startup_s`` is the
process's time outside its steps; ``steal_pct`` the share of the machine's CPU time a shared
host gave to other machines meanwhile (a slow run on a busy host says so). ``graphs`` says what
the decoding graphs held (``whole steps``, ``model step``, ``none``). ``--profile`` profiles each
run's last step (``step_profile.py``; out of the medians) and prints its phases: host time, device
time, kernels, the longest kernel.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from common import GIB, print_table, write_record
from compute_floor import (
    decode_floor_s,
    decode_products_s,
    decode_products_streamed_s,
    decode_roofline_s,
    decode_ways,
    matmul_rates,
    model_shape,
    phase_flops,
    read_bandwidth,
    step_flops,
)
from sides import PHASES, run_side
from step_profile import PROFILE_COLUMNS, PROFILE_LEGEND, phase_rows
from workloads import LORA_RANK, describe

COLUMNS = ["mode", "graphs", "tokens", "step_s", *PHASES, "other_s", "x_floor", "x_roofline", "products_x_floor",
           "logprobs_x_floor", "update_x_floor", "gen_x_floor", "gen_x_roofline", "gen_x_streamed", "decode_ms",
           "warmup_s", "loop_rss_gib", "tree_rss_gib", "cuda_gib", "steal_pct", "error"]  # fmt: skip
WARMUP = ["mode", "warmup_s", "warmup_gen_s", "warmup_logprobs_s", "warmup_update_s", "warmup_other_s",
          "graph_record_s", "startup_s"]  # fmt: skip


def device_floor(workload, bandwidth_gbs: float | None = None) -> dict:
    """The model's shape, the device's matmul rate (FLOP/s: the faster way it multiplies, each way's
    in ``rates``) and read bandwidth (bytes/s; a GPU's from ``bandwidth_gbs``, else none); on a CPU a decoding
    step's products at the workload's rows (``decode_products_s``)."""
    import torch

    if workload.threads:  # the runs' threads
        torch.set_num_threads(workload.threads)
    device = "cuda" if workload.accelerator == "gpu" else "cpu"
    shape = model_shape(workload.model_path())
    bandwidth = bandwidth_gbs * 1e9 if bandwidth_gbs else read_bandwidth() if device == "cpu" else None
    rates = matmul_rates(shape, workload.dtype, device=device)
    rows = workload.prompts * workload.group
    ways = decode_ways(shape, workload.dtype, rows) if device == "cpu" and shape.kv_width else None
    products = decode_products_s(shape, workload.dtype, rows, ways) if ways else None
    streamed = decode_products_streamed_s(shape, workload.dtype, rows, ways) if ways else None
    return {"shape": shape, "rate": max(rates.values()), "rates": rates, "bandwidth": bandwidth, "products": products,
            "streamed": streamed}  # fmt: skip


def better_floor(floor: dict, again: dict) -> dict:
    """The faster of two measurements of the same device (a quiet moment of a shared machine)."""
    best = lambda key: max(v for v in (floor[key], again[key]) if v) if floor[key] or again[key] else None
    rates = {way: max(rate, again["rates"].get(way, 0.0)) for way, rate in floor["rates"].items()}
    least = lambda key: min((v for v in (floor.get(key), again.get(key)) if v), default=None)
    bests = {"rate": best("rate"), "bandwidth": best("bandwidth")}
    return {**floor, **bests, "rates": rates, "products": least("products"), "streamed": least("streamed")}


def summary(label: dict, runs: list[dict], workload, floor: dict) -> dict:
    """One table row from runs' per-step records, each run's first step and profiled step left out."""
    row = dict(label)
    errors = [r["error"] for r in runs if "error" in r]
    runs = [r for r in runs if "error" not in r]
    if not runs:
        return {**row, "error": errors[0]["reason"], "log_tail": errors[0]["log_tail"]}
    profiled = lambda run: run.get("profile", {}).get("step")
    steps = [s for r in runs for i, s in enumerate(r["steps"]) if i and i != profiled(r)]
    med = lambda values: statistics.median(list(values))
    row |= {"runs": len(runs), "tokens": med(s["tokens"] for s in steps), "step_s": med(s["step_s"] for s in steps)}
    row |= {key: med(s[key] for s in steps) for key in PHASES}
    row["other_s"] = med(s["step_s"] - sum(s[k] for k in PHASES) for s in steps)
    row["run_medians_s"] = [med(s["step_s"] for s in r["steps"][1:]) for r in runs]
    add_floors(row, steps, workload, floor)
    add_warmup(row, runs)
    row |= {
        # the steps, no exit, nor a profiled step's (the profiler's own records)
        "loop_rss_gib": max(s["rss_bytes"] for r in runs for i, s in enumerate(r["steps"]) if i != profiled(r)) / GIB,
        "cmd_rss_gib": max(r["peak_rss_bytes"] for r in runs) / GIB,  # the whole process, its exit included
        "tree_rss_gib": max(r["tree_peak_rss_bytes"] for r in runs) / GIB,  # with child processes
        "steal_pct": max((r["steal_pct"] for r in runs if r.get("steal_pct") is not None), default=None),
        "cuda_gib": max(s.get("cuda_peak_bytes", 0) for r in runs for s in r["steps"]) / GIB,
        "reserved_gib": max(s.get("cuda_reserved_bytes", 0) for r in runs for s in r["steps"]) / GIB,
        "logprob_diff_max": max(s.get("logprob_diff_max", float("nan")) for r in runs for s in r["steps"]),
        "per_step": [r["steps"] for r in runs],
    }
    if any("profile" in r for r in runs):
        row["profile"] = next(r["profile"] for r in runs if "profile" in r)
        products = [p["products_s"] for p in row["profile"]["phases"].values() if p.get("products_s")]
        if products:  # a CPU's: the profiled step's linear products alone, against the step's floor
            row["products_x_floor"] = sum(products) / row["floor_s"]
    return row


def add_floors(row: dict, steps: list[dict], workload, floor: dict) -> None:
    """Step / floor, each pass's time over its FLOPs' time, generation over its reads' time."""
    shape, rate, bandwidth, frozen = floor["shape"], floor["rate"], floor["bandwidth"], workload.lora_rank > 0
    med = lambda values: statistics.median(list(values))
    row["floor_s"] = med(step_flops(s, shape, frozen=frozen) / rate for s in steps)
    row["x_floor"] = med(s["step_s"] * rate / step_flops(s, shape, frozen=frozen) for s in steps)
    for phase in ("logprobs", "update"):
        flops = [phase_flops(s, shape, frozen=frozen)[phase] for s in steps]
        row[f"{phase}_x_floor"] = med(s[f"{phase}_s"] * rate / f for s, f in zip(steps, flops))
    value_bytes = 2 if workload.dtype in ("bfloat16", "float16") else 4
    reads = [decode_floor_s(s, shape, bandwidth, value_bytes) for s in steps] if bandwidth else [None]
    if None not in reads:  # fixed lengths only: a natural length's rows per decoding step are not kept
        row["decode_ms"] = med(1e3 * s["gen_s"] * s["rows"] / s["tokens"] for s in steps)
        row["gen_x_floor"] = med(s["gen_s"] / r for s, r in zip(steps, reads))
    if floor.get("products") and None not in reads:
        roof = [decode_roofline_s(s, shape, rate, floor["products"], bandwidth, value_bytes) for s in steps]
        row["gen_x_roofline"] = med(s["gen_s"] / r for s, r in zip(steps, roof))
        passes = [(step_flops(s, shape, frozen=frozen) - phase_flops(s, shape)["rollout"]) / rate for s in steps]
        row["x_roofline"] = med(s["step_s"] / (r + p) for s, r, p in zip(steps, roof, passes))
    if floor.get("streamed") and None not in reads:  # the products as a step reads their weights: from memory
        roof = [decode_roofline_s(s, shape, rate, floor["streamed"], bandwidth, value_bytes) for s in steps]
        row["gen_x_streamed"] = med(s["gen_s"] / r for s, r in zip(steps, roof))


def add_warmup(row: dict, runs: list[dict]) -> None:
    """The first step's excess over the median step, by phase, and the process's time outside its steps."""
    first = [r["steps"][0] for r in runs]
    excess = lambda key: statistics.median(f[key] for f in first) - row[key]
    row["warmup_s"] = max(0.0, excess("step_s"))
    split = {f"warmup_{k}": excess(k) for k in ("gen_s", "logprobs_s", "update_s")}
    row |= split | {"warmup_other_s": excess("step_s") - sum(split.values())}
    row["startup_s"] = statistics.median(r["wall_s"] - sum(s["step_s"] for s in r["steps"]) for r in runs)
    row["graph_record_s"] = statistics.median(sum(s.get("graph_record_s", 0.0) for s in r["steps"]) for r in runs)
    whole = [s["whole_step_graphs"] for r in runs for s in r["steps"] if "whole_step_graphs" in s]
    row["graphs"] = "none" if not whole else "whole steps" if min(whole) == 1 else "model step"


def run(args, workload) -> None:
    floor = device_floor(workload, args.bandwidth_gbs)
    results: list[tuple[str, dict]] = []  # (mode, its run), in the order they ran
    with tempfile.TemporaryDirectory(prefix="floor-") as work:
        try:
            for index, mode in enumerate(args.modes * args.runs):
                options = profile_options(args, workload, index)
                result = run_side("ours", in_mode(workload, mode), Path(work), index, options)
                results.append((mode, result))
                print(f"{mode}: {brief(result)}", flush=True)
        except KeyboardInterrupt:  # a time limit: the runs done are reported
            print("interrupted: reporting the runs that finished")
    floor = better_floor(floor, device_floor(workload, args.bandwidth_gbs))
    rows = [summary({"mode": mode}, [result], in_mode(workload, mode), floor) for mode, result in results]
    report(rows)
    figures = {"matmul_gflops": floor["rate"] / 1e9, "model_shape": asdict(floor["shape"])}
    figures["matmul_gflops_by_way"] = {way: rate / 1e9 for way, rate in floor["rates"].items()}
    figures["read_gbps"] = floor["bandwidth"] / 1e9 if floor["bandwidth"] else None
    figures["decode_products_ms"] = floor["products"] * 1e3 if floor.get("products") else None
    figures["decode_products_streamed_ms"] = floor["streamed"] * 1e3 if floor.get("streamed") else None
    write_record(
        "floor",
        device_of(workload),
        f"{describe(workload)}; modes {' '.join(args.modes)}",
        "x_floor",
        True,
        args.out,
        settings=asdict(workload),
        summary=brief_rows(rows, "mode"),
        rows=rows,
        **figures,
    )


def in_mode(workload, mode: str):
    """The workload in a mode: ``full`` as it is, ``lora`` with adapters of rank :data:`LORA_RANK`."""
    return replace(workload, lora_rank=LORA_RANK) if mode == "lora" else workload


def profile_options(args, workload, index: int) -> tuple[str, ...]:
    """The last step profiled (stopping the profiler takes seconds), its trace where asked."""
    if not args.profile:
        return ()
    options = ("--profile-step", str(workload.steps - 1))
    if args.trace_dir:
        options += ("--trace", str(args.trace_dir / f"{index}-{args.modes[index % len(args.modes)]}.trace.json.gz"))
    return options


def brief(result: dict) -> str:
    if "error" in result:
        return f"FAILED after {result['wall_s']:.0f} s: {result['error']['reason']}\n{result['error']['log_tail']}"
    steps = [s["step_s"] for s in result["steps"]]
    return f"{len(steps)} steps in {result['wall_s']:.0f} s: " + ", ".join(f"{t:.2f}" for t in steps) + " s"


def report(rows: list[dict]) -> None:
    print()
    print_table(rows, COLUMNS)
    print("\nthe first step's excess over the median step (warmup_s), by phase; startup_s: outside the steps")
    print_table([r for r in rows if "error" not in r], WARMUP)
    phases = [p for r in rows if "profile" in r for p in phase_rows({"mode": r["mode"]}, r["profile"]["phases"])]
    if phases:
        print(f"\nthe profiled step, by phase ({PROFILE_LEGEND})")
        print_table(phases, ["mode", "phase", *PROFILE_COLUMNS])


def brief_rows(rows: list[dict], key: str) -> dict:
    """Each row's main figures, by its ``key`` (numbered where it repeats), for a record's summary."""
    keep = ("step_s", "x_floor", "x_roofline", "products_x_floor", "gen_x_floor", "gen_x_roofline", "gen_x_streamed")
    keep += ("warmup_s", "cmd_rss_gib", "cuda_gib", "vs_ours", "steal_pct", "error")
    repeats = len({r[key] for r in rows}) < len(rows)
    return {(f"{i + 1}. " if repeats else "") + r[key]: {k: r[k] for k in keep if k in r} for i, r in enumerate(rows)}


def device_of(workload) -> str:
    return "cuda" if workload.accelerator == "gpu" else "cpu"
