"""``harness.py speedup NAME``: a workload with one speed-up on and with it off, alternated.

``NAME`` is one of the backend's speed-ups (on: ``backend.enable=[NAME]``, so also where it is off
by default; off: ``backend.disable=[NAME]``) or a setting of ``workloads.SETTINGS``
(``nondeterministic``: the default against ``trainer.deterministic=true``). Each run is the
workload's ``ngrpo train`` in a process of its own (``side_ours.py``, in the environment ``make
train`` gives the command, or on the system's malloc with ``--allocator system``), the two arms
alternated ``--pairs`` times (on, off, off, on, ...) so that a slow spell of a shared machine falls
on both. An arm's figure is the median over its runs' steps after the first (the first pays for
warm-up and the backend's measurements), or its largest peak (``--metric peak_gib``: the GPU's
allocated memory on a GPU, else the process's RSS). The record holds both, ``with`` and ``without``.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

from common import GIB, write_record
from floor import brief, device_of
from sides import PHASES, run_side
from workloads import arms, describe


def figures(result: dict) -> dict:
    """A run's step times, its phases' medians after the first step and its peak."""
    steps = result["steps"]
    cuda = max(s.get("cuda_peak_bytes", 0) for s in steps)
    later = steps[1:] or steps
    return {
        "step_s": [s["step_s"] for s in steps],
        **{key: statistics.median(s[key] for s in later) for key in PHASES},
        "peak_gib": (cuda or result["peak_rss_bytes"]) / GIB,
    }


def arm_figure(runs: list[dict], metric: str) -> float:
    if metric == "peak_gib":
        return max(r["peak_gib"] for r in runs)
    return statistics.median(t for r in runs for t in (r["step_s"][1:] or r["step_s"]))


def run(args, workload) -> None:
    on, off = arms(workload, args.speedup)
    runs: dict[str, list[dict]] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory(prefix="speedup-") as work:
        for pair in range(args.pairs):
            for arm in ("with", "without") if pair % 2 == 0 else ("without", "with"):
                index = 2 * pair + (arm == "without")
                result = run_side("ours", on if arm == "with" else off, Path(work), index, allocator=args.allocator)
                print(f"pair {pair + 1}, {arm} {args.speedup}: {brief(result)}", flush=True)
                if "error" in result:
                    raise SystemExit(f"{arm} {args.speedup} failed: {result['error']['reason']}")
                runs[arm].append(figures(result))
    with_, without = arm_figure(runs["with"], args.metric), arm_figure(runs["without"], args.metric)
    print(f"\n{args.metric}: {with_:.3f} with {args.speedup}, {without:.3f} without: {without / with_:.3f}x")
    write_record("speedup", device_of(workload), describe(workload), args.metric, True, args.out,
                 speedup=args.speedup, settings=asdict(workload), **{"with": with_, "without": without}, runs=runs,
                 overrides={"with": list(on.extra), "without": list(off.extra)}, allocator=args.allocator)  # fmt: skip
