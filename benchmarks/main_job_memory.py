"""What the main job costs the machine, measured on the whole ``ngrpo train`` command.

Runs ``ngrpo train`` (the defaults, plus the given overrides) in a fresh folder, as a user
would, and reports: the peak RSS of the ``ngrpo`` process (its kernel high-water mark), the
peak of the whole process tree (verifier workers included; sampled every 0.1 s, summed), the
wall time of the command, and the median ``time/step_s`` of its steps after the first (read
from the run's MLflow store). Several ``--variant`` options (each a quoted list of overrides) run one
after the other in the same invocation, so their ratios come from one sitting of the machine;
the first is the baseline of the ``x step`` column. The command runs in the environment ``make
train`` gives it (mimalloc preloaded, freed memory kept: Makefile, ``RUN_ENV``); ``--plain-env``
runs it without.

    .venv/bin/python benchmarks/main_job_memory.py --steps 4 -- optim.micro_batch_size=8
    .venv/bin/python benchmarks/main_job_memory.py --steps 4 --variant "backend.packing=off" --variant ""
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, tree_rss  # noqa: E402
from vs_trl_workload import launcher_env  # noqa: E402


def high_water_mark(pid: int) -> int:
    """The kernel's peak RSS of a live process (VmHWM), in bytes; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(overrides: list[str], steps: int, env: dict | None = None) -> dict:
    from mlflow import MlflowClient

    with tempfile.TemporaryDirectory(prefix="main-job-") as tmp:
        store = f"sqlite:///{tmp}/mlruns.db"
        cmd = [str(Path(sys.executable).parent / "ngrpo"), "train", f"trainer.max_steps={steps}"]
        cmd += [f"logger.tracking_uri={store}", *overrides]
        t0 = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        proc = subprocess.Popen(
            cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
        )
        tree_peak, hwm = 0, 0
        while proc.poll() is None:
            tree_peak = max(tree_peak, tree_rss(proc.pid))
            hwm = max(hwm, high_water_mark(proc.pid))  # monotonic: the last read is within 0.1 s of the end
            time.sleep(0.1)
        wall = time.perf_counter() - t0
        output = proc.stdout.read()
        if proc.returncode != 0:
            raise RuntimeError(f"ngrpo train failed:\n{output[-3000:]}")
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        client = MlflowClient(store)
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        steps_s = [
            m.value for m in sorted(client.get_metric_history(run.info.run_id, "time/step_s"), key=lambda m: m.step)
        ]
        phases = {  # medians after the first step: where a step's time goes
            key: statistics.median(v[1:] or v)
            for key in run.data.metrics
            if key.startswith(("time/", "async/")) or key == "rollout/time_s"
            for v in [[m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]]
        }
    return {
        "overrides": overrides,
        # the kernel's figure once the process is reaped (KiB) when it is this process's largest child so far
        "main_peak_bytes": peak * 1024 if peak > before else hwm,
        "tree_peak_bytes": tree_peak,
        "wall_s": wall,
        "step_s": statistics.median(steps_s[1:] or steps_s),
        "steps_s": steps_s,
        "phases": phases,
        "console": output,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variant", action="append", help="overrides of one variant, quoted (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS / "main_job_memory.json")
    parser.add_argument("--plain-env", action="store_true", help="without the launcher's allocator environment")
    parser.add_argument("overrides", nargs="*", help="ngrpo train overrides of every variant (after --)")
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    variants = [v.split() for v in (args.variant or [""])]
    gib, results = 2**30, []
    print(f"{'main peak GiB':>14} {'tree peak GiB':>14} {'wall s':>8} {'s/step':>8} {'x step':>7}  overrides")
    for extra in variants:
        result = measure([*args.overrides, *extra], args.steps, None if args.plain_env else launcher_env())
        results.append(result)
        ratio = result["step_s"] / results[0]["step_s"]
        label = " ".join(result["overrides"]) or "(defaults)"
        print(
            f"{result['main_peak_bytes'] / gib:14.2f} {result['tree_peak_bytes'] / gib:14.2f} "
            f"{result['wall_s']:8.1f} {result['step_s']:8.2f} {ratio:7.3f}  {label}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results if len(results) > 1 else results[0], indent=1))


if __name__ == "__main__":
    main()
