"""The default job launched both ways: ``ngrpo train`` and a script that builds the same run with
``build_run`` and trains it with its own ``lightning.Trainer`` (docs/python-api.md). They go
through the same builder, so they should step as fast and peak as high, within the noise.

Each way runs ``--steps`` steps of the packaged model (no validation) as its own process, the two
alternated ``--pairs`` times; each run's step time is the median of its steps after the first
(``time/step_s`` in its MLflow store) and its peak the process tree's resident memory, sampled
every half second. Both run on the system allocator (no launcher environment), as a script would.

    python benchmarks/api_vs_cli.py                 # about 5 minutes on 2 cores

Writes ``results/records/api_vs_cli-<date>.json``: the CPU, the commit, each run's figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from common import RESULTS, cpu_kind, step_times, wait_watching_rss

SCRIPT = textwrap.dedent("""
    import sys
    import lightning as L
    from lightning.pytorch.loggers import MLFlowLogger
    from ngrpo_lightning import build_run

    out, steps = sys.argv[1], sys.argv[2]
    run = build_run([f"trainer.max_steps={steps}", "validate_before_fit=false", f"output_dir={out}"])
    logger = MLFlowLogger(experiment_name="api", tracking_uri=f"sqlite:///{out}/mlruns.db")
    L.Trainer(**run.trainer_kwargs(logger=logger)).fit(run.module, datamodule=run.datamodule)
""")


def run_once(way: str, steps: int, folder: Path) -> dict:
    out = folder / f"{way}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    if way == "cli":
        command = [sys.executable, "-m", "ngrpo_lightning.commands.launch", "train", f"trainer.max_steps={steps}"]
        command += ["validate_before_fit=false", f"output_dir={out}", f"logger.tracking_uri=sqlite:///{out}/mlruns.db"]
    else:
        script = folder / "script.py"
        script.write_text(SCRIPT)
        command = [sys.executable, str(script), str(out), str(steps)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = wait_watching_rss(proc, interval_s=0.5)
    if proc.returncode:
        raise SystemExit(f"{way}: exit status {proc.returncode}")
    times = step_times(f"sqlite:///{out}/mlruns.db")
    return {"step_s": times, "median_step_s": statistics.median(times[1:]), "peak_gib": peak / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    runs = {"cli": [], "script": []}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            for way in runs:
                result = run_once(way, args.steps, Path(tmp))
                runs[way].append(result)
                print(
                    f"pair {pair + 1}, {way}: {result['median_step_s']:.2f} s a step, peak {result['peak_gib']:.2f} GiB"
                )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    summary = {
        way: {
            "median_step_s": statistics.median(r["median_step_s"] for r in results),
            "peak_gib": max(r["peak_gib"] for r in results),
        }
        for way, results in runs.items()
    }
    record = {
        "benchmark": "api_vs_cli",
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "cpu": cpu_kind(),
        "workload": f"the default job (packaged model, built-in task), {args.steps} steps, no validation, "
        "system allocator",
        "runs": runs,
        "summary": summary,
        "script_over_cli_step": summary["script"]["median_step_s"] / summary["cli"]["median_step_s"],
    }
    path = RESULTS / "records" / f"api_vs_cli-{record['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(summary), f"script/cli step: {record['script_over_cli_step']:.2f}; wrote {path}")


if __name__ == "__main__":
    main()
