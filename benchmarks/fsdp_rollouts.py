"""A policy FSDP2 shards, rolled out both ways (rollout/sharded_decoding.py): on a copy of its
gathered weights, the backend's choice where the copy fits, and through the sharded policy,
whose FSDP2 hooks run at every decoding step. Each way is one ``ngrpo train`` process of its own
(FSDP2 over one process, or ``--devices``), the ways alternated ``--runs`` times; the table gives
the mean seconds of each step phase from Lightning's simple profiler (``ngrpo/rollout``,
``ngrpo/logprobs``, ``ngrpo/update``) and the line the run printed about its rollouts.

"Through" is the device's own backend with the copy refused (registered here as ``<device>_through``),
so nothing else differs. Responses have a fixed length (EOS ignored).

    python benchmarks/fsdp_rollouts.py                        # the CPU (trainer=fsdp_cpu), the packaged model
    python benchmarks/fsdp_rollouts.py --accelerator gpu      # one GPU (trainer=fsdp)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, print_table, write_json  # noqa: E402

PHASES = ("rollout", "logprobs", "update")
ROW = re.compile(r"^\|\s*ngrpo/(\w+)\s*\|\s*([\d.]+)\s*\|")


def child(argv: list[str]) -> int:
    """``ngrpo train`` with the ``<device>_through`` backends registered (a process of its own)."""
    from ngrpo_lightning.backends.base import BACKENDS
    from ngrpo_lightning.commands.cli import main

    for device in ("cpu", "cuda"):

        class Through(BACKENDS[device]):
            def decodes_sharded_on_copy(self, copy_bytes, device):
                return False

        BACKENDS.register(f"{device}_through")(Through)
    return main(argv)


def run(way: str, args, out: Path) -> dict:
    gpu = args.accelerator == "gpu"
    trainer = ["trainer=fsdp"] if gpu else ["trainer=fsdp_cpu", "trainer.parallel.data_parallel_size=auto"]
    backend = ("cuda" if gpu else "cpu") + ("_through" if way == "through the policy" else "")
    overrides = [
        "train", "experiment=grpo", f"model.name_or_path={args.model}", *trainer, f"trainer.devices={args.devices}",
        f"data.prompts_per_step={args.prompts}", f"rollout.max_new_tokens={args.tokens}", "rollout.ignore_eos=true",
        f"trainer.max_steps={args.steps}", "validate_before_fit=false", "checkpoint.every_n_steps=0",
        "trainer.enable_checkpointing=false", "logger=none", "trainer.enable_progress_bar=false",
        "+trainer.profiler=simple", f"backend.name={backend}", f"output_dir={out}", *args.extra,
    ]  # fmt: skip
    if args.problems:
        overrides += ["data=files", f"data.train={args.problems}", f"data.val={args.problems}"]
    row = {"way": way, "backend.name": backend}
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", *overrides], capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {**row, "error": f"over {args.timeout} s"}
    for line in (proc.stdout + proc.stderr).splitlines():  # Lightning prints the profiler's table to stderr
        match = ROW.match(line.strip())
        if match and match.group(1) in PHASES:
            row.setdefault(f"{match.group(1)}_s", float(match.group(2)))  # the first table's
    said = [line for line in proc.stderr.splitlines() if line.startswith("ngrpo: decoding")]
    row["said"] = said[0].removeprefix("ngrpo: ")[:60] if said else ""
    if proc.returncode != 0:
        row["error"] = proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else f"rc {proc.returncode}"
    return row


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model.name_or_path")
    ap.add_argument("--devices", type=int, default=1, help="processes FSDP2 shards over")
    ap.add_argument("--prompts", type=int, default=4, help="data.prompts_per_step (x 8 samples)")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--runs", type=int, default=2, help="times each way runs, alternated")
    ap.add_argument("--problems", default="", help="a .jsonl of problems (a machine without reasoning-gym)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--extra", nargs="*", default=[], help="more `ngrpo train` overrides")
    ap.add_argument("--out", default=str(RESULTS / "fsdp_rollouts.json"))
    args = ap.parse_args()
    rows = []
    for i in range(args.runs):
        for way in ("through the policy", "on a copy"):
            rows.append({"run": i + 1, **run(way, args, Path(args.out).parent / f"fsdp-run-{way.split()[-1]}")})
            print(rows[-1], flush=True)
    print_table(rows, ["run", "way", *(f"{p}_s" for p in PHASES), "said", "error"])
    meta = {k: getattr(args, k) for k in ("accelerator", "model", "devices", "prompts", "tokens", "steps")}
    write_json("fsdp_rollouts", rows, args.out, **meta)


if __name__ == "__main__":
    main()
