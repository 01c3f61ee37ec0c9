"""A side of a comparison in a process of its own: this project's ``ngrpo train`` (``side_ours.py``)
or TRL's GRPOTrainer (``side_trl.py``) on a :class:`~workloads.Workload`.

The driver starts a side's script with the workload as JSON (:func:`run_side`); the script's
:func:`child_main` runs it and writes its per-step records (``step_s``, the :data:`PHASES`,
``tokens``, the :func:`prompt_counts`, ``rss_bytes``) and its peak RSS back as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from common import GIB, cpu_times, kill_tree, stolen_pct, wait_watching_rss
from compute_floor import attention_pairs
from workloads import Workload

HERE = Path(__file__).parent
# side -> (its script, what it changes in the workload)
SIDES = {
    "ours": ("side_ours.py", {}),
    "trl": ("side_trl.py", {}),
    "trl-ac": ("side_trl.py", {"activation_checkpointing": True}),  # TRL's default activation checkpointing
}
PHASES = ("gen_s", "reward_s", "logprobs_s", "update_s")


def prompt_counts(row_prompt_lengths: list[int], group: int, row_response_lengths: list[int]) -> dict:
    """Token counts of a step's rows (grouped by prompt, ``group`` rows each) and attention's
    query-key pairs (``compute_floor.attention_pairs``)."""
    return {
        "rows": len(row_prompt_lengths),
        "row_prompt_tokens": sum(row_prompt_lengths),
        "prompt_tokens": sum(row_prompt_lengths[::group]),  # each distinct prompt once
        **attention_pairs(row_prompt_lengths, row_response_lengths, group),
    }


def peak_rss_now() -> int:
    """This process's peak RSS so far, in bytes (the kernel's high-water mark)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_main(run) -> None:
    """A side's process: ``run(workload, options)`` returns ``{"steps": [...], ...}``, written with
    the process's peak RSS as JSON to ``--out``."""
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True, help="Workload as JSON")
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile-step", type=int, default=0, help="profile this step (0: none)")
    ap.add_argument("--trace", default="", help="with --profile-step: its Chrome trace here")
    ap.add_argument("--memory", default="", choices=["", "meter", "trim"], help="peak RSS per phase")
    options = ap.parse_args()
    workload = Workload.from_json(options.workload)
    if workload.threads:
        torch.set_num_threads(workload.threads)
    result = run(workload, options)
    result |= {"peak_rss_bytes": peak_rss_now(), "threads_at_end": torch.get_num_threads()}
    Path(options.out).write_text(json.dumps(result))


def child_env(workload: Workload, side: str, allocator: str = "launcher") -> dict:
    """A side's environment. Ours gets what the ``ngrpo`` command gives its process (:func:`command_env`):
    OpenMP's spin and the allocator, mimalloc with ``allocator="launcher"``, the C library's malloc with
    ``"system"`` (``NGRPO_ALLOCATOR=system``)."""
    environ = dict(os.environ)
    if side == "ours":
        environ.update(command_env(allocator))
    if workload.threads:
        environ |= {"OMP_NUM_THREADS": str(workload.threads), "MKL_NUM_THREADS": str(workload.threads)}
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # both sides load a local directory
    return {**environ, **offline, "TOKENIZERS_PARALLELISM": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}


def command_env(allocator: str = "launcher") -> dict[str, str]:
    """What the ``ngrpo`` command of this virtual environment sets for its process (``ngrpo env``: the allocator,
    OpenMP's spin; a value exported here wins, as it does for the command); empty where that command is missing."""
    environ = {**os.environ, **({"NGRPO_ALLOCATOR": "system"} if allocator == "system" else {})}
    try:
        out = subprocess.run([str(Path(sys.executable).parent / "ngrpo"), "env"], capture_output=True, text=True,
                             check=True, env=environ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def run_side(side: str, workload: Workload, workdir: Path, index: int, options: tuple[str, ...] = (),
             limit_bytes: int | None = None, allocator: str = "launcher") -> dict:  # fmt: skip
    """One run of a side in a fresh process (``options``: :func:`child_main`'s): its records, its
    process tree's peak RSS, wall time and the CPU time stolen meanwhile (``steal_pct``, see
    :func:`common.stolen_pct`), or ``error`` (also above ``limit_bytes``: stopped there)."""
    out, log = workdir / f"{index}-{side}.json", workdir / f"{index}-{side}.log"
    script, changes = SIDES[side]
    cmd = [sys.executable, str(HERE / script), "--workload", replace(workload, **changes).to_json(), "--out", str(out)]
    t0, ticks = time.perf_counter(), cpu_times()
    with open(log, "w") as fh:
        environ = child_env(workload, side, allocator)
        proc = subprocess.Popen([*cmd, *options], stdout=fh, stderr=subprocess.STDOUT, env=environ)
        try:
            tree_peak = wait_watching_rss(proc, limit_bytes=limit_bytes)
        finally:
            if proc.poll() is None:  # Ctrl-C or an error here: the child and its workers go too
                kill_tree(proc)
    wall, steal = time.perf_counter() - t0, stolen_pct(ticks, cpu_times())
    if limit_bytes is not None and tree_peak > limit_bytes:
        reason = f"MemoryError: stopped at {tree_peak / GIB:.1f} GiB, above {limit_bytes / GIB:.1f} GiB"
        return {"error": {"returncode": proc.returncode, "reason": reason, "log_tail": ""}, "wall_s": wall}
    if proc.returncode != 0 or not out.exists():
        return {"error": failure(log.read_text(errors="replace"), proc.returncode), "wall_s": wall}
    return {**json.loads(out.read_text()), "tree_peak_rss_bytes": tree_peak, "wall_s": wall, "steal_pct": steal}


def failure(log: str, returncode: int, tail: int = 40) -> dict:
    """Why a side failed: the last exception line of its log (the reason) and the log's tail."""
    lines = [line for line in log.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]
    return {
        "returncode": returncode,
        "reason": raised[-1] if raised else (lines[-1] if lines else f"exit status {returncode}"),
        "log_tail": "\n".join(lines[-tail:]),
    }
