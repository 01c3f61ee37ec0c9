"""Prompt sharing under FSDP2 (``optim.share_prompts``), measured on the whole ``ngrpo train``.

Runs ``ngrpo train trainer=fsdp_cpu`` (2 processes, gloo, one thread each) on the packaged model
with prompt sharing on and off, alternated, and reads each run's step metrics from its MLflow
store: the log-prob phase (reference forward), the update (training forward and backward) and
the whole step, medians over the steps after the first. Losses of the two settings are printed
side by side: sharing changes FLOPs, not values.

    .venv/bin/python benchmarks/fsdp_prompt_sharing.py --steps 4 --repeats 1 --out fsdp_sharing.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

KEYS = ("time/step_s", "time/logprobs_s", "time/update_s", "rollout/time_s", "train/loss", "train/kl_ref")


def run(share: bool, steps: int, extra: list[str]) -> dict[str, list[float]]:
    """One ``ngrpo train`` on 2 FSDP2 processes; its per-step metrics."""
    from mlflow import MlflowClient

    with tempfile.TemporaryDirectory(prefix="fsdp-sharing-") as tmp:
        store = f"sqlite:///{tmp}/mlruns.db"
        args = [
            "trainer=fsdp_cpu",
            f"trainer.max_steps={steps}",
            "trainer.enable_checkpointing=false",
            "trainer.enable_progress_bar=false",
            "checkpoint.every_n_steps=0",
            "validate_before_fit=false",
            "data.val_size=0",
            f"optim.share_prompts={str(share).lower()}",
            f"logger.tracking_uri={store}",
            "logger.system_metrics=false",
            f"output_dir={tmp}/out",
            *extra,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
        cmd = [sys.executable, "-m", "ngrpo_lightning.commands.cli", "train", *args]
        subprocess.run(cmd, cwd=tmp, env=env, check=True, capture_output=True, text=True)
        client = MlflowClient(store)
        (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        history = lambda k: sorted(client.get_metric_history(found.info.run_id, k), key=lambda m: m.step)  # noqa: E731
        return {k: [m.value for m in history(k)] for k in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is dropped)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per setting, alternated")
    parser.add_argument("--out", type=Path, default=Path("fsdp_prompt_sharing.json"))
    parser.add_argument("overrides", nargs="*", help="more ngrpo train overrides")
    args = parser.parse_args()
    runs = {True: [], False: []}
    for _ in range(args.repeats):
        for share in (True, False):
            runs[share].append(run(share, args.steps, args.overrides))
    rows = []
    for share, results in runs.items():
        row = {"share_prompts": share}
        for key in KEYS[:4]:
            row[key] = statistics.median(v for r in results for v in r[key][1:])
        row["loss"] = results[0]["train/loss"]
        rows.append(row)
    print(f"{'share_prompts':>13} {'step s':>8} {'logprobs s':>10} {'update s':>9} {'rollout s':>9}  losses")
    for r in rows:
        times = [r[k] for k in KEYS[:4]]
        losses = " ".join(f"{x:.6f}" for x in r["loss"])
        print(
            f"{str(r['share_prompts']):>13} {times[0]:8.2f} {times[1]:10.2f} {times[2]:9.2f} {times[3]:9.2f}  {losses}"
        )
    on, off = rows
    print(f"step time, shared / unshared: {on['time/step_s'] / off['time/step_s']:.2f}x")
    args.out.write_text(json.dumps({"steps": args.steps, "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
