"""The side-by-side benchmark's workload, and how each side runs it in its own process.

``Workload`` is what both sides run (``vs_trl.py``'s docstring says what each field means for
each side). A side is a script (``vs_trl_ours.py``, ``vs_trl_trl.py``) that the driver starts
in a fresh subprocess with the workload as JSON (:func:`run_side`); the script's
:func:`child_main` runs it and writes its per-step records and peak RSS back as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from common import kill_tree, wait_watching_rss  # noqa: E402
from compute_floor import attention_pairs  # noqa: E402

# side -> (its script, what it changes in the workload)
SIDES = {
    "ours": ("vs_trl_ours.py", {}),
    "trl": ("vs_trl_trl.py", {}),
    "trl-ac": ("vs_trl_trl.py", {"activation_checkpointing": True}),
    "ours-unpacked": ("vs_trl_ours.py", {"ours_overrides": ("backend.packing=off",)}),  # plain products
    "ours-eager": ("vs_trl_ours.py", {"ours_overrides": ("backend.name=cuda_eager",)}),  # a GPU: no graphs
}
PHASES = ("gen_s", "reward_s", "logprobs_s", "update_s")
GIB = 1024**3


@dataclass(frozen=True)
class Workload:
    """What both sides run; the defaults are the benchmark's workload."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    prompts: int = 4  # prompts per step
    group: int = 8  # completions per prompt
    tokens: int = 40  # new tokens per completion (exactly, unless natural)
    natural: bool = False  # EOS on: natural lengths, at most `tokens`
    temperature: float = 1.0
    kl_coef: float = 0.001
    lr: float = 2e-5
    steps: int = 5  # optimizer steps per run
    engine: str = "hf"  # hf | vllm
    threads: int = 2
    seed: int = 0
    saves: bool = True  # checkpoints as each side's defaults save them (False: none on either side)
    activation_checkpointing: bool = False  # TRL's side only (the trl-ac row)
    lora_rank: int = 0  # > 0: both sides train LoRA adapters of this rank (alpha 2 x rank) on every linear layer
    micro_batch: int = 0  # rows per forward/backward of the update, both sides (0: the whole batch at once)
    ours_overrides: tuple[str, ...] = ()  # this project's side only: extra `ngrpo train` overrides (a baseline row)
    profile_step: int = 0  # this project's side only: > 0 profiles that step (0-based; benchmarks/step_profile.py)
    profile_trace: str = ""  # with profile_step: write its Chrome trace here too
    problems: str = ""  # a .jsonl of problems (data=files) instead of the built-in task (TRL reads our prompts)
    accelerator: str = "cpu"  # cpu | gpu: where both sides train (ours: trainer=gpu; TRL: use_cpu=False)

    def model_path(self) -> str:
        """The local model directory both sides load (a packaged model is built once)."""
        from ngrpo_lightning.models.loading import resolve_model_path

        return resolve_model_path(self.model)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Workload:
        return cls(**json.loads(text))


# ------------------------------------------------------------ a side's process
def prompt_counts(row_prompt_lengths: list[int], group: int, row_response_lengths: list[int] | None = None) -> dict:
    """Token counts of a step's prompts (rows are grouped by prompt, ``group`` rows each) and,
    given the rows' response lengths, attention's query-key pairs (``compute_floor.attention_pairs``)."""
    counts = {
        "rows": len(row_prompt_lengths),
        "row_prompt_tokens": sum(row_prompt_lengths),
        "prompt_tokens": sum(row_prompt_lengths[::group]),  # each distinct prompt once
    }
    if row_response_lengths is not None:
        counts.update(attention_pairs(row_prompt_lengths, row_response_lengths, group))
    return counts


def peak_rss_now() -> int:
    """This process's peak RSS so far, in bytes (the kernel's high-water mark)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_main(run) -> None:
    """Entry point of a side's subprocess: ``run(workload)`` returns the per-step records
    (keys ``step_s``, the ``PHASES``, ``tokens``, the ``prompt_counts`` and ``rss_bytes``, the
    :func:`peak_rss_now` at the step's end); they are written,
    with the process's peak RSS, as JSON to ``--out``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True, help="Workload as JSON")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    workload = Workload.from_json(args.workload)
    torch.set_num_threads(workload.threads)
    steps = run(workload)
    result = {"steps": steps, "peak_rss_bytes": peak_rss_now(), "threads_at_end": torch.get_num_threads()}
    Path(args.out).write_text(json.dumps(result))


def child_env(workload: Workload, side: str = "trl") -> dict:
    """A side's environment. This project's side gets what ``make train`` gives the ``ngrpo``
    command: OpenMP's short spin (ngrpo_lightning/commands/launch.py) and the launcher's allocator
    environment, mimalloc preloaded where installed (Makefile, ``RUN_ENV``; since 2026-11-25, the
    tables before ran without them)."""
    import os

    from ngrpo_lightning.commands import launch

    threads = str(workload.threads)
    environ = dict(os.environ)
    if side.startswith("ours"):
        if "OMP_WAIT_POLICY" not in environ:
            environ.setdefault("GOMP_SPINCOUNT", launch.GOMP_SPINCOUNT)
        environ.update(launcher_env())
    return {
        **environ,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_OFFLINE": "1",  # both sides load a local directory: no Hub look-ups
        "TRANSFORMERS_OFFLINE": "1",
    }


def launcher_env() -> dict[str, str]:
    """The allocator environment ``make train`` runs the command in (``make run-env``), for this
    virtual environment; empty where ``make`` is missing."""
    try:
        out = subprocess.run(
            ["make", "-s", "-C", str(HERE.parent), "run-env", f"BIN={Path(sys.executable).parent}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def run_side(side: str, workload: Workload, workdir: Path, index: int, limit_bytes: int | None = None) -> dict:
    """One run of a side in a fresh subprocess: its per-step records and peak RSS, or ``error``
    (also when its process tree goes above ``limit_bytes``: stopped there)."""
    out, log = workdir / f"{index}-{side}.json", workdir / f"{index}-{side}.log"
    script, changes = SIDES[side]
    cmd = [sys.executable, str(HERE / script), "--workload", replace(workload, **changes).to_json(), "--out", str(out)]
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=child_env(workload, side))
        try:
            tree_peak = wait_watching_rss(proc, limit_bytes=limit_bytes)
        finally:
            if proc.poll() is None:  # Ctrl-C or an error here: the child and its workers go too
                kill_tree(proc)
    wall = time.perf_counter() - t0
    if limit_bytes is not None and tree_peak > limit_bytes:
        reason = f"MemoryError: stopped at {tree_peak / GIB:.1f} GiB, above the limit of {limit_bytes / GIB:.1f} GiB"
        return {"error": {"returncode": proc.returncode, "reason": reason, "log_tail": ""}, "wall_s": wall}
    if proc.returncode != 0 or not out.exists():
        return {"error": failure(log.read_text(errors="replace"), proc.returncode), "wall_s": wall}
    return {**json.loads(out.read_text()), "tree_peak_rss_bytes": tree_peak, "wall_s": wall}


def failure(log: str, returncode: int, tail: int = 40) -> dict:
    """Why a side failed: the last exception line of its log (the reason) and the log's tail."""
    lines = [line for line in log.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]
    return {
        "returncode": returncode,
        "reason": raised[-1] if raised else (lines[-1] if lines else f"exit status {returncode}"),
        "log_tail": "\n".join(lines[-tail:]),
    }
