"""Rollouts ahead of training (``train.max_staleness``) against the on-policy loop, on the whole
``ngrpo train`` command.

For each response length, runs ``ngrpo train`` (the defaults plus the given overrides) with
each staleness, one after the other in this invocation (one sitting of the machine), and
reports per step (medians after the first): the step time and its ratio to staleness 0, the
rollout's own time, the trainer's (log-prob passes + update), how long each side waited on the
other, and the process's peak RSS. The throughput model of ``docs/async.md`` reads these:
the on-policy step costs rollout + train; ahead, ``max(rollout, train)`` when the two sides do
not share their cores, and more when they do.

    .venv/bin/python benchmarks/rollouts_ahead.py --steps 6 --tokens 40 256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS  # noqa: E402
from main_job_memory import measure  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tokens", type=int, nargs="+", default=[40, 256], help="response lengths (fixed: ignore_eos)")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", type=Path, default=RESULTS / "rollouts_ahead.json")
    parser.add_argument("overrides", nargs="*", help="ngrpo train overrides of every run (after --)")
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    gib, rows = 2**30, []
    header = f"{'tokens':>6} {'k':>2} {'s/step':>7} {'x k=0':>6} {'rollout s':>9} {'train s':>8}"
    print(f"{header} {'trainer waits s':>15} {'worker waits s':>14} {'peak GiB':>8}")
    for tokens in args.tokens:
        base = None
        for k in args.staleness:
            fixed = [f"rollout.max_new_tokens={tokens}", "rollout.ignore_eos=true", f"train.max_staleness={k}"]
            result = measure([*args.overrides, *fixed], args.steps)
            p = result["phases"]
            base = base or result["step_s"]
            row = {
                "tokens": tokens,
                "max_staleness": k,
                "step_s": result["step_s"],
                "x_on_policy": result["step_s"] / base,
                "rollout_s": p.get("rollout/time_s"),
                "train_s": p.get("time/logprobs_s", 0.0) + p.get("time/update_s", 0.0),
                "trainer_wait_s": p.get("async/trainer_wait_s", 0.0),
                "worker_wait_s": p.get("async/generator_wait_s", 0.0),
                "peak_bytes": result["main_peak_bytes"],
                "steps_s": result["steps_s"],
                "overrides": result["overrides"],
            }
            rows.append(row)
            print(
                f"{tokens:6d} {k:2d} {row['step_s']:7.2f} {row['x_on_policy']:6.3f} {row['rollout_s']:9.2f} "
                f"{row['train_s']:8.2f} {row['trainer_wait_s']:15.2f} {row['worker_wait_s']:14.2f} "
                f"{row['peak_bytes'] / gib:8.2f}",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
