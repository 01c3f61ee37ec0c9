"""Where a step's memory goes: peak RSS per phase of this project's side of ``vs_trl.py``.

Runs the side-by-side workload (the real ``ngrpo train``, ``vs_trl_ours.py``'s configuration)
in a fresh process per configuration. Around each phase of a step (the rollout, the
reference log-probs, the update and, inside it, the optimizer step) it resets the process's
peak-RSS mark (Linux: ``/proc/self/clear_refs``, "5") and reads it back (``VmHWM``) at the
phase's end, so each phase gets its own high-water mark. It also records the resident memory
at fixed points (after the imports, with both models loaded, after each step) and the bytes
the tensors of the run hold (weights, gradients, AdamW state), which the RSS is compared with.

    .venv/bin/python benchmarks/step_memory_phases.py                 # ~6 minutes
    .venv/bin/python benchmarks/step_memory_phases.py --steps 4 --configs default no-packing

A phase's peak includes what earlier phases left resident: freed blocks stay in the process
(by design under ``make train``'s allocator environment; by glibc's heap otherwise), so the
``trimmed`` configuration hands freed memory back (``malloc_trim``) before each phase: its
phase peaks are what each phase needs on top of the memory alive when it starts.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import peak_rss_bytes, reset_peak, rss_bytes  # noqa: E402
from vs_trl_ours import run as run_ours  # noqa: E402
from vs_trl_workload import Workload  # noqa: E402

GIB = 2**30
LORA = ["model.lora.enabled=true", "model.lora.rank=16", "model.lora.alpha=32"]  # experiment=ngrpo-lora's adapters
CONFIGS = {  # name -> overrides on top of the workload's
    "default": [],
    "no-packing": ["backend.packing=off"],
    "micro-batch-8": ["optim.micro_batch_size=8"],
    "micro-batch-16": ["optim.micro_batch_size=16"],
    "trimmed": [],  # and malloc_trim before each phase: live memory only
    "trimmed-micro-batch-16": ["optim.micro_batch_size=16"],
    "lora": LORA,
    "lora-micro-batch-8": [*LORA, "optim.micro_batch_size=8"],
    "lora-trimmed": LORA,
    "lora-trimmed-micro-batch-8": [*LORA, "optim.micro_batch_size=8"],
}
TRIMMED = {"trimmed", "trimmed-micro-batch-16", "lora-trimmed", "lora-trimmed-micro-batch-8"}
PHASES = ["rollout", "reference", "update", "optimizer"]


class PhaseMeter:
    """Per-phase peak RSS; a phase inside another (the optimizer step in the update) counts
    towards both, and the process's peak is the largest mark ever read."""

    def __init__(self, trim: bool = False):
        self.trim = ctypes.CDLL("libc.so.6").malloc_trim if trim else None
        self.stack: list[list] = []  # [name, running peak]
        self.peaks: dict[str, list[int]] = {name: [] for name in PHASES}
        self.process_peak = peak_rss_bytes()

    def fold(self) -> None:
        """Count the peak since the last reset towards the process and every open phase."""
        mark = peak_rss_bytes()
        self.process_peak = max(self.process_peak, mark)
        for frame in self.stack:
            frame[1] = max(frame[1], mark)

    @contextmanager
    def phase(self, name: str):
        self.fold()
        if self.trim is not None:  # hand freed heap memory back: the mark then starts at live memory
            self.trim(0)
        reset_peak()
        self.stack.append([name, rss_bytes()])
        try:
            yield
        finally:
            self.fold()
            _, peak = self.stack.pop()
            self.peaks[name].append(peak)
            reset_peak()

    def wrap(self, owner, attribute: str, name: str):
        """``mock.patch.object`` that runs ``owner.attribute`` inside phase ``name``."""
        original = getattr(owner, attribute)
        meter = self

        def timed(*args, **kwargs):
            with meter.phase(name):
                return original(*args, **kwargs)

        return mock.patch.object(owner, attribute, timed)


# ------------------------------------------------------------- the run (child)
def tensor_bytes(tensors) -> int:
    """Bytes held by the tensors' storages, each counted once (a file-backed reference's
    placeholders between passes hold one element each)."""
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class Milestones(L.Callback):
    """Resident memory at fixed points and the bytes the run's tensors hold."""

    def __init__(self):
        self.points: dict[str, int] = {}
        self.after_step: list[int] = []
        self.tensors: dict[str, int] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.points["models loaded"] = rss_bytes()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after_step.append(rss_bytes())

    def on_train_end(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        self.tensors = {
            "policy weights": tensor_bytes(pl_module.policy.parameters()),
            "reference weights": tensor_bytes(pl_module.reference.parameters()) if pl_module.reference else 0,
            "gradients": tensor_bytes(p.grad for p in pl_module.policy.parameters()),
            "AdamW state": tensor_bytes(v for state in optimizer.state.values() for v in state.values()),
        }


def child(workload: Workload, extra: list[str], out: Path, trim: bool = False) -> None:
    from ngrpo_lightning.rollout.hf_engine import HFEngine
    from ngrpo_lightning.training.module import RLModule

    torch.set_num_threads(workload.threads)
    after_imports = rss_bytes()
    meter = PhaseMeter(trim)
    milestones = Milestones()
    with (
        meter.wrap(HFEngine, "generate", "rollout"),
        meter.wrap(RLModule, "prepare", "reference"),
        meter.wrap(RLModule, "optimize", "update"),
        meter.wrap(torch.optim.AdamW, "step", "optimizer"),
    ):
        steps = run_ours(workload, extra, [milestones])
    meter.fold()
    result = {
        "after_imports": after_imports,
        "points": milestones.points,
        "after_step": milestones.after_step,
        "tensors": milestones.tensors,
        "phase_peaks": meter.peaks,
        "peak": meter.process_peak,
        "steps": steps,
    }
    out.write_text(json.dumps(result))


# ------------------------------------------------------------------ the driver
def run_config(name: str, workload: Workload, workdir: Path) -> dict:
    out = workdir / f"{name}.json"
    cmd = [sys.executable, __file__, "--child", name, "--workload", workload.to_json(), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"configuration {name!r} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def summarize(name: str, r: dict) -> dict:
    """One table row, GiB; a phase's figure is its median peak over the steps after the first."""

    def steady(values: list[int]) -> float:
        later = values[1:] or values
        return sorted(later)[len(later) // 2] / GIB

    row = {"config": name, "imports": r["after_imports"] / GIB, "models": r["points"]["models loaded"] / GIB}
    row.update({phase: steady(r["phase_peaks"][phase]) for phase in PHASES})
    row["after_step"] = steady(r["after_step"])
    row["peak"] = r["peak"] / GIB
    row["tensors"] = sum(r["tensors"].values()) / GIB
    row["first_step_peak"] = max(r["phase_peaks"][p][0] for p in PHASES if r["phase_peaks"][p]) / GIB
    return row


def report(rows: list[dict], tensors: dict[str, int]) -> None:
    cols = ["config", "imports", "models", *PHASES, "after_step", "peak", "first_step_peak", "tensors"]
    print("GiB resident; phases: median peak over the steps after the first")
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(row[c] if isinstance(row[c], str) else f"{row[c]:.2f}" for c in cols))
    print("\ntensors of the run (after the last step):")
    for key, value in tensors.items():
        print(f"  {key}: {value / GIB:.2f} GiB")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per configuration (default 3)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--natural", action="store_true", help="EOS on (natural lengths)")
    ap.add_argument("--out", default="benchmarks/results/step_memory_phases.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(Workload.from_json(args.workload), CONFIGS[args.child], Path(args.out), args.child in TRIMMED)
        return
    workload = Workload(steps=args.steps, natural=args.natural)
    rows, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="step-memory-") as tmp:
        for i, name in enumerate(args.configs, 1):
            raw[name] = run_config(name, workload, Path(tmp))
            rows.append(summarize(name, raw[name]))
            print(f"{i}/{len(args.configs)} {name}: peak {rows[-1]['peak']:.2f} GiB", flush=True)
    report(rows, raw[args.configs[0]]["tensors"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"workload": json.loads(workload.to_json()), "rows": rows, "raw": raw}, indent=1)
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
