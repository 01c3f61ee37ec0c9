"""What bit-for-bit reproducibility costs: the default job's step with default settings and with
``trainer.deterministic=true`` (Lightning's deterministic algorithms, and the backend's choices
fixed: products never packed, where the default measures per shape what this CPU runs faster).

Each setting runs ``--steps`` training steps of the packaged model (no validation) as its own
``ngrpo train`` process, the two alternated ``--pairs`` times so that a slow spell of a shared
machine falls on both. The figure is the median of the steps after the first (the first pays for
the backend's measurements and warm-up) from the run's ``time/step_s`` in its MLflow store.

    python benchmarks/deterministic_cost.py            # about 5 minutes on 2 cores
    python benchmarks/deterministic_cost.py --steps 6 --pairs 3

Writes ``results/records/deterministic_cost-<date>.json``: the CPU (model and kernels), the
commit, and each run's step times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, cpu_kind, step_times

SETTINGS = {"default": [], "deterministic": ["trainer.deterministic=true"]}


def run_once(setting: str, steps: int, folder: Path) -> list[float]:
    out = folder / f"{setting}-{time.monotonic_ns()}"
    store = f"sqlite:///{out}/mlruns.db"
    command = [sys.executable, "-m", "ngrpo_lightning.commands.launch", "train", f"trainer.max_steps={steps}"]
    command += ["validate_before_fit=false", f"output_dir={out}", f"logger.tracking_uri={store}", *SETTINGS[setting]]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return step_times(store)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    runs = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            for name in SETTINGS:
                times = run_once(name, args.steps, Path(tmp))
                runs[name].append(times)
                print(f"pair {pair + 1}, {name}: " + ", ".join(f"{t:.1f}" for t in times) + " s a step")
    median = {name: statistics.median(t for times in r for t in times[1:]) for name, r in runs.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {
        "benchmark": "deterministic_cost",
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "cpu": cpu_kind(),
        "cores": len(__import__("os").sched_getaffinity(0)),
        "workload": f"the default job (packaged model, built-in task), {args.steps} steps, no validation",
        "step_s": runs,
        "median_step_s_after_the_first": median,
        "deterministic_over_default": median["deterministic"] / median["default"],
    }
    path = RESULTS / "records" / f"deterministic_cost-{record['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"median step: default {median['default']:.2f} s, deterministic {median['deterministic']:.2f} s "
        f"({record['deterministic_over_default']:.2f}x); wrote {path}"
    )


if __name__ == "__main__":
    main()
