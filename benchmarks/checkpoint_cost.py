"""What checkpoints cost a run, measured on the whole ``ngrpo train`` command.

Each arm is one ``ngrpo train`` in a child process on the default configuration (packaged
model, built-in task), ``--steps`` steps with a checkpoint after every step:

- ``none``: ``trainer.enable_checkpointing=false``, the baseline;
- ``streamed``: the default writer (``checkpoint_io.StreamingCheckpointIO``);
- ``async``: ``checkpoint.async_save=true`` (the streamed writer in Lightning's ``AsyncCheckpointIO``);
- ``lightning``: Lightning's own ``TorchCheckpointIO`` (the writer before this project's), for
  comparison only: the arm swaps the writer in the child (there is no config key for it).

It reports each arm's wall time, the child's peak RSS, the time a save adds per checkpoint
((arm - none) / saves) and the size of ``last.ckpt``.

    .venv/bin/python benchmarks/checkpoint_cost.py --steps 3 --out checkpoint_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS  # noqa: E402

ARMS = {
    "none": ["trainer.enable_checkpointing=false"],
    "streamed": [],
    "async": ["checkpoint.async_save=true"],
    "lightning": [],
}


def child(arm: str, steps: int, out: Path) -> None:
    """One run of the arm, in this process; writes {wall_s, peak_rss_bytes, size_bytes}."""
    from ngrpo_lightning.build import components
    from ngrpo_lightning.commands import cli
    from ngrpo_lightning.config import compose

    if arm == "lightning":
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        components.checkpoint_io = lambda async_save=False: TorchCheckpointIO()
    folder = Path(tempfile.mkdtemp(prefix="ckpt-cost-"))
    overrides = [
        f"trainer.max_steps={steps}",
        "checkpoint.every_n_steps=1",
        "validate_before_fit=false",
        "data.val_size=0",
        "logger=none",
        "trainer.enable_progress_bar=false",
        f"output_dir={folder}",
        *ARMS[arm],
    ]
    t0 = time.perf_counter()
    cli.train(compose(overrides))
    wall = time.perf_counter() - t0
    last = folder / "checkpoints" / "last.ckpt"
    size = last.resolve().stat().st_size if last.exists() else 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.write_text(json.dumps({"wall_s": wall, "peak_rss_bytes": peak, "size_bytes": size}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--runs", type=int, default=1, help="runs per arm, arms alternated")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--out", type=Path, default=RESULTS / "checkpoint_cost.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.steps, args.child_out)
    results: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for arm in args.arms:
                out = Path(tmp) / f"{arm}-{run}.json"
                cmd = [sys.executable, __file__, "--child", arm, "--steps", str(args.steps), "--child-out", str(out)]
                subprocess.run(cmd, check=True, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
                results[arm].append(json.loads(out.read_text()))
    best = {arm: min(r["wall_s"] for r in rs) for arm, rs in results.items()}
    gib = 2**30
    print(f"{'arm':<10} {'wall s':>8} {'per save s':>10} {'peak RSS GiB':>13} {'last.ckpt GB':>13}")
    for arm, rs in results.items():
        per_save = (best[arm] - best["none"]) / args.steps if "none" in best and arm != "none" else float("nan")
        peak = max(r["peak_rss_bytes"] for r in rs) / gib
        size = max(r["size_bytes"] for r in rs) / 1e9
        print(f"{arm:<10} {best[arm]:8.1f} {per_save:10.2f} {peak:13.2f} {size:13.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
