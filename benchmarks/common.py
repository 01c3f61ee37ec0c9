"""What every benchmark shares: the machine it ran on, the dated record it writes, prompts, resident
memory and process trees, tables."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
RECORDS = RESULTS / "records"  # kept in git: the records a document quotes
GIB = 2**30
# what a model folder built here from a config takes from its source folder: the tokenizer and chat template
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


# ------------------------------------------------------------------ the machine and the record
def cpu_kind() -> dict:
    """The processor's name, the widest kernels it has (AMX, AVX-512, AVX2) and whether it has
    native bfloat16 products (avx512_bf16)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = text.splitlines()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    kernels = "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return {"cpu": name, "kernels": kernels, "avx512_bf16": "avx512_bf16" in flags}


def gpu_name() -> str | None:
    """The first GPU's name (from the driver, without starting CUDA here), or None."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        return out.splitlines()[0].strip() if out.strip() else None
    return None


# the environment variables that hold torch's, oneDNN's and MKL's kernels below what the CPU has
KERNEL_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def machine() -> dict:
    """The machine a record was measured on; ``kernel_limits`` where the run held its kernels
    below the CPU's own (measuring narrower kernels on a wider CPU is not that kind of CPU)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    limits = {name: os.environ[name] for name in KERNEL_LIMITS if os.environ.get(name)}
    return {**cpu_kind(), "gpu": gpu_name(), "cores": cores, **({"kernel_limits": limits} if limits else {})}


def cpu_times() -> dict[str, int]:
    """The machine's CPU time so far, in clock ticks (``/proc/stat``'s first line; empty elsewhere)."""
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    try:
        values = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return {}
    return dict(zip(names, map(int, values)))


def stolen_pct(before: dict[str, int], after: dict[str, int]) -> float | None:
    """The share of the CPU time between two :func:`cpu_times` that the hypervisor gave to other
    machines (``steal``), in percent: a shared host's contention, which slows a run without
    showing in its own figures."""
    if not before or not after:
        return None
    total = sum(after.values()) - sum(before.values())
    return 100.0 * (after["steal"] - before["steal"]) / total if total > 0 else None


def commit() -> str:
    """The checkout's commit, with ``+`` where its files differ from it."""
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=Path(__file__).parent).stdout
    head = git("rev-parse", "--short", "HEAD").strip()
    return head + ("+" if head and git("status", "--porcelain", "--untracked-files=no").strip() else "")


def write_record(question: str, device: str, workload: str, metric: str, lower_is_better: bool,
                 out: str | Path | None = None, speedup: str = "", **fields) -> Path:  # fmt: skip
    """A dated record: ``records/<question>[-<speedup>]-<device>-<date>[-N].json`` (``-2``, ``-3``, ...
    for another of the same day), or ``out``. ``workload`` says what ran, in words; ``fields`` add
    the question's figures (a comparison: ``with``, ``without`` and the ``runs``)."""
    date = time.strftime("%Y-%m-%d")
    record = {"question": question, **({"speedup": speedup} if speedup else {}), "device": device, "date": date,
              "commit": commit(), "machine": machine(), "workload": workload, "metric": metric,
              "lower_is_better": lower_is_better, **fields}  # fmt: skip
    name = "-".join(part for part in (question, speedup, device, date) if part)
    path = Path(out) if out else RECORDS / f"{name}.json"
    for n in range(2, 100):
        if out or not path.exists():
            break
        path = RECORDS / f"{name}-{n}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {path}")
    return path


# ------------------------------------------------------------------ prompts and model folders
def arithmetic_prompt_ids(tokenizer, n: int, seed: int = 0, problems: str = "") -> list[list[int]]:
    """``n`` chat-templated prompts of the built-in task, or the first ``n`` of a problems file
    (a machine without reasoning-gym reads what ``harness.py problems`` wrote)."""
    from ngrpo_lightning.config import compose
    from ngrpo_lightning.data import load_problems, reasoning_gym_problems, render_prompt

    chosen = load_problems(problems, limit=n) if problems else reasoning_gym_problems(compose([]).data.tasks, n, seed)
    return [tokenizer(render_prompt(tokenizer, p.question), add_special_tokens=False)["input_ids"] for p in chosen]


def copy_tokenizer(source: Path, out: Path) -> None:
    """The :data:`TOKENIZER_FILES` of ``source`` that exist, copied into ``out``."""
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            (Path(out) / name).write_bytes((Path(source) / name).read_bytes())


# ------------------------------------------------------------------ resident memory (Linux /proc)
def status_bytes(key: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` figure (VmRSS, VmHWM) in bytes; 0 where the process is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_bytes() -> int:
    return status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """This process's peak RSS since it started or since the last :func:`reset_peak`."""
    return status_bytes("VmHWM")


def reset_peak() -> None:
    """Reset the kernel's peak-RSS mark of this process to its RSS now (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants (0 once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def tree_pids(pid: int) -> list[int]:
    import psutil

    with contextlib.suppress(psutil.Error):
        return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    return []


def wait_watching_rss(proc: subprocess.Popen, interval_s: float = 1.0, limit_bytes: int | None = None) -> int:
    """Wait for ``proc``; the peak RSS of its process tree, sampled every ``interval_s``. A tree
    above ``limit_bytes`` is killed (the returned peak then exceeds the limit)."""
    peak = 0
    while True:
        peak = max(peak, tree_rss(proc.pid))
        if limit_bytes is not None and peak > limit_bytes:
            kill_tree(proc)
            return peak
        try:
            proc.wait(timeout=interval_s)
            return peak
        except subprocess.TimeoutExpired:
            continue


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and its descendants (reward workers, vLLM), and reap ``proc``."""
    import psutil

    for pid in reversed(tree_pids(proc.pid)):
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    proc.wait()


# ------------------------------------------------------------------ tables
def print_table(rows: list[dict], columns: list[str] | None = None) -> None:
    """``rows`` as a text table (default columns: every row's keys, in order)."""
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    widths = [max([len(c), *(len(fmt(r.get(c))) for r in rows)]) for c in columns]
    print(" | ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):  # small magnitudes (a log-prob gap) keep two significant digits
        return f"{v:.2f}" if v == 0 or abs(v) >= 0.01 or v != v else f"{v:.2g}"
    return str(v)
