"""``harness.py main_job``: the whole default command as a user runs it: its wall time, its peak
resident memory and its steps.

Ways to run it: ``make`` (``make train ARGS=...``), ``ngrpo`` (the virtual environment's ``ngrpo
train`` run directly; both on the allocator the command chooses, ``ngrpo env``) and ``script`` (a
script that builds the same run with ``build_run`` and trains it with its own ``lightning.Trainer``,
docs/python-api.md: the C library's malloc); a way may name environment variables it runs with
(``ngrpo,NGRPO_ALLOCATOR=system``: the command on the C library's malloc). Several ways alternate
``--pairs`` times. Each run starts in a fresh folder; its main process's peak is the kernel's
high-water mark, its tree's peak (answer-checking workers included) the sum sampled every 0.1 s,
its steps' times are read from its MLflow store (the median counts the steps after the first).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from common import GIB, print_table, status_bytes, tree_pids, tree_rss, write_record
from workloads import describe, train_overrides

ROOT = Path(__file__).parents[1]
WAYS = ("make", "ngrpo", "script")
SCRIPT = """
import json, sys
import lightning as L
from lightning.pytorch.loggers import MLFlowLogger
from ngrpo_lightning import build_run

overrides, store = json.loads(sys.argv[1]), sys.argv[2]
run = build_run(overrides)
logger = MLFlowLogger(experiment_name="script", tracking_uri=store)
L.Trainer(**run.trainer_kwargs(logger=logger)).fit(run.module, datamodule=run.datamodule)
"""


def command(way: str, overrides: list[str], folder: Path) -> list[str]:
    if way == "make":
        venv = f"BIN={Path(sys.executable).parent}"
        return ["make", "-s", "-C", str(ROOT), "train", venv, f"ARGS={' '.join(overrides)}"]
    if way == "ngrpo":
        return [str(Path(sys.executable).parent / "ngrpo"), "train", *overrides]
    (folder / "script.py").write_text(SCRIPT)
    store = next(o.split("=", 1)[1] for o in overrides if o.startswith("logger.tracking_uri="))
    return [sys.executable, str(folder / "script.py"), json.dumps(overrides), store]


def split_way(spec: str) -> tuple[str, dict[str, str]]:
    """``WAY[,NAME=VALUE...]``: a way to run the command and the environment variables it runs with."""
    way, *assignments = spec.split(",")
    if way not in WAYS or any("=" not in a for a in assignments):
        raise ValueError(f"--via {spec!r}: a way ({', '.join(WAYS)}), then optionally ,NAME=VALUE pairs")
    return way, dict(a.split("=", 1) for a in assignments)


def measure(overrides: list[str], way: str = "ngrpo", extra_env: dict[str, str] | None = None) -> dict:
    """One run of the command, writing into a fresh folder, with ``extra_env`` set (:func:`split_way`)."""
    extra_env = extra_env or {}
    with tempfile.TemporaryDirectory(prefix="main-job-") as tmp:
        store = f"sqlite:///{tmp}/mlruns.db"
        overrides = [*overrides, f"output_dir={tmp}/outputs", f"logger.tracking_uri={store}"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t0 = time.perf_counter()
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", **extra_env}
        proc = subprocess.Popen(command(way, overrides, Path(tmp)), cwd=tmp, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
        tree_peak, hwm = 0, 0
        while proc.poll() is None:
            tree_peak = max(tree_peak, tree_rss(proc.pid))
            hwm = max([hwm, *(status_bytes("VmHWM", pid) for pid in tree_pids(proc.pid))])
            time.sleep(0.1)
        wall = time.perf_counter() - t0
        output = proc.stdout.read()
        if proc.returncode != 0:
            raise RuntimeError(f"{way}: the command failed:\n{output[-3000:]}")
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest reaped descendant's
        history = metric_history(store)
    steps = history.pop("time/step_s")
    return {
        "way": way,
        "env": extra_env,
        "overrides": overrides[:-2],
        "main_peak_bytes": peak if peak > before * 1024 else hwm,  # the kernel's, when a new largest child
        "tree_peak_bytes": tree_peak,
        "wall_s": wall,
        "step_s": statistics.median(steps[1:] or steps),
        "steps_s": steps,
        "phases": {k: statistics.median(v[1:] or v) for k, v in history.items()},  # where a step's time goes
        "console": output,
    }


def metric_history(store: str) -> dict[str, list[float]]:
    """The one run in an MLflow store: its step time and phases, each in step order."""
    from mlflow import MlflowClient

    client = MlflowClient(store)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    keys = [k for k in run.data.metrics if k.startswith(("time/", "async/")) or k == "rollout/time_s"]
    by_step = lambda key: sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
    return {key: [m.value for m in by_step(key)] for key in keys}


def way_summary(runs: list[dict]) -> dict:
    """A way's medians of wall and step time, and its largest peaks."""
    return {
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "step_s": statistics.median(r["step_s"] for r in runs),
        "peak_gib": max(r["main_peak_bytes"] for r in runs) / GIB,
        "tree_peak_gib": max(r["tree_peak_bytes"] for r in runs) / GIB,
    }


def job_overrides(workload) -> list[str]:
    """The workload's command line but where it writes (each run writes into a fresh folder)."""
    return [o for o in train_overrides(workload, "") if not o.startswith(("output_dir=", "logger.tracking_uri="))]


def run(args, workload) -> None:
    ways = {spec: split_way(spec) for spec in args.via}  # a misspelt way fails before the first run
    runs: dict[str, list[dict]] = {way: [] for way in args.via}
    for pair in range(args.pairs):
        for way in args.via if pair % 2 == 0 else args.via[::-1]:
            result = measure(job_overrides(workload), *ways[way])
            runs[way].append(result)
            print(f"pair {pair + 1}, {way}: {result['wall_s']:.1f} s, {result['step_s']:.2f} s a step, "
                  f"peak {result['main_peak_bytes'] / GIB:.2f} GiB", flush=True)  # fmt: skip
    summary = {way: way_summary(rs) for way, rs in runs.items()}
    print()
    print_table([{"way": way, **figures} for way, figures in summary.items()])
    kept = {way: [{k: v for k, v in r.items() if k != "console"} for r in rs] for way, rs in runs.items()}
    write_record("main_job", "cpu", f"{describe(workload)}; via {', '.join(args.via)}", "wall_s", True, args.out,
                 settings=asdict(workload), summary=summary, runs=kept)  # fmt: skip
