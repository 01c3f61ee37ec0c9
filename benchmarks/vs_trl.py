"""``harness.py vs_trl``: this project's side and TRL 1.16's GRPOTrainer on the side-by-side workload.

Both sides load the same model directory and train on the same prompts in the same order (TRL
reads our ``RolloutDataModule``'s prompt texts, unshuffled), 4 prompts x 8 completions of exactly
40 tokens (TRL: ``min_new_tokens``; ours: ``rollout.ignore_eos``), the same reward (ngrpo's
``MathReward``), GRPO with a k3 KL term to a frozen reference, one fused AdamW step per rollout
batch, 2 threads in each side's process. Sides: ``ours``; ``trl``, TRL without activation
checkpointing (the same work per step as ours); ``trl-ac``, TRL with its default activation
checkpointing (what a TRL user gets). Each run is a process of its own, the sides alternated
(ours, trl, trl, ours, ...) so that a slow spell of the machine falls on all; each run's first
step is dropped. The rows are ``floor.summary``'s (phases, step / floor, memory); ``vs_ours`` is a
side's step over ours. ``--extra`` overrides change our side only (e.g. ``backend.name=cuda_eager``).
TRL is an optional dependency: ``pip install -e ".[bench]"``.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import asdict
from pathlib import Path

from common import print_table, write_record
from floor import better_floor, brief, brief_rows, device_floor, device_of, summary
from sides import PHASES, run_side
from workloads import describe

COLUMNS = ["side", "runs", "step_s", "vs_ours", *PHASES, "other_s", "tokens", "floor_s", "x_floor",
           "loop_rss_gib", "cmd_rss_gib", "tree_rss_gib", "cuda_gib"]  # fmt: skip


def run_order(runs: int, sides: list[str]) -> list[str]:
    """ours, trl, trl-ac, trl-ac, trl, ours, ...: a slow spell of the machine falls on every side."""
    return [side for r in range(runs) for side in (sides if r % 2 == 0 else sides[::-1])]


def run(args, workload) -> None:
    floor = device_floor(workload, args.bandwidth_gbs)
    results: dict[str, list[dict]] = {side: [] for side in args.sides}
    failed: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as work:
        for i, side in enumerate(run_order(args.runs, args.sides)):
            if side in failed:  # a side that fails is not run again
                continue
            result = run_side(side, workload, Path(work), i)
            print(f"run {i + 1} {side}: {brief(result)}", flush=True)
            if "error" in result:
                failed[side] = result["error"]
            else:
                results[side].append(result)
    floor = better_floor(floor, device_floor(workload, args.bandwidth_gbs))
    rows = [summary({"side": side}, runs, workload, floor) for side, runs in results.items() if runs]
    ours = next((r for r in rows if r["side"] == "ours"), None)
    for row in rows:
        row["vs_ours"] = row["step_s"] / ours["step_s"] if ours else None
    print()
    print_table(rows, COLUMNS)
    for side, error in failed.items():
        print(f"\n{side} did not run: {error['reason']}")
    write_record("vs_trl", device_of(workload), describe(workload), "step_s", True, args.out, settings=asdict(workload),
                 summary=brief_rows(rows, "side"), rows=rows,
                 failed=failed, order=run_order(args.runs, args.sides), versions=versions(),
                 matmul_gflops=floor["rate"] / 1e9,
                 matmul_gflops_by_way={way: rate / 1e9 for way, rate in floor["rates"].items()})  # fmt: skip


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("trl", "transformers", "lightning", "torch"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found
