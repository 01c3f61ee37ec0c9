"""``harness.py profile``: where a step's time and memory go, per phase, in one run of the workload.

The run (``side_ours.py``) profiles its last step (``step_profile.py``: each phase's host time,
its kernels' time on the device, their count and the longest; on a CPU its linear products' time
and rate) and reads each phase's peak RSS in every step (``memory_phases.py``; ``--trim``: freed
heap memory handed back before each phase). The steps' own phase times (``gen_s``, ...) are
medians over the steps after the first and before the profiled one, as are the memory peaks; a
step's first use of memory is reported apart (``first_step_peak_gib``).
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

from common import GIB, print_table, write_record
from floor import brief, device_of
from memory_phases import PHASES as MEMORY_PHASES
from sides import PHASES, run_side
from step_profile import PROFILE_COLUMNS, PROFILE_LEGEND, phase_rows
from workloads import describe


def steady(values: list, profiled: int) -> float:
    """The median of the steps after the first and before the profiled one (all where none is left)."""
    return statistics.median(values[1:profiled] or values)


def memory_row(memory: dict, profiled: int) -> dict:
    peaks = memory["phase_peaks"]
    row = {"imports_gib": memory["points"]["imports"] / GIB, "models_gib": memory["points"]["models loaded"] / GIB}
    row |= {f"{phase}_gib": steady(peaks[phase], profiled) / GIB for phase in MEMORY_PHASES if peaks[phase]}
    row["after_step_gib"] = steady(memory["after_step"], profiled) / GIB
    row["peak_gib"] = memory["peak"] / GIB
    row["first_step_peak_gib"] = max(peaks[p][0] for p in MEMORY_PHASES if peaks[p]) / GIB
    row["tensors_gib"] = {k: v / GIB for k, v in memory["tensors"].items()}
    return row


def run(args, workload) -> None:
    if workload.steps < 3:
        raise SystemExit("profile: --steps must be at least 3 (a warm-up step, a measured one, the profiled last)")
    profiled = workload.steps - 1
    options = ("--profile-step", str(profiled), "--memory", "trim" if args.trim else "meter")
    options += ("--trace", str(args.trace)) if args.trace else ()
    with tempfile.TemporaryDirectory(prefix="profile-") as work:
        result = run_side("ours", workload, Path(work), 0, options, allocator=args.allocator)
    print(brief(result), flush=True)
    if "error" in result:
        raise SystemExit(1)
    times = {key: steady([s[key] for s in result["steps"]], profiled) for key in ("step_s", *PHASES)}
    phases = phase_rows({}, result["profile"]["phases"])
    memory = memory_row(result["memory"], profiled)
    print("\nsteps' phases, s:", ", ".join(f"{k} {v:.3f}" for k, v in times.items()))
    print(f"\nthe profiled step ({profiled}), by phase ({PROFILE_LEGEND})")
    print_table(phases, ["phase", *PROFILE_COLUMNS])
    print("\nresident memory, GiB (phases: their own peaks)")
    print_table([{k: v for k, v in memory.items() if k != "tensors_gib"}])
    print("tensors of the run, GiB:", ", ".join(f"{k} {v:.2f}" for k, v in memory["tensors_gib"].items()))
    write_record("profile", device_of(workload), describe(workload), "step_s", True, args.out,
                 settings=asdict(workload), step_s=times,
                 profile=result["profile"], memory=memory, raw_memory=result["memory"],
                 steps=result["steps"], allocator=args.allocator)  # fmt: skip
