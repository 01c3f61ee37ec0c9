"""Helpers shared by the benchmark scripts: prompts, timing, resident memory, table printing, JSON output."""

from __future__ import annotations

import contextlib
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
# what a model folder built here from a config takes from its source folder: the tokenizer and chat template
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def copy_tokenizer(source: Path, out: Path) -> None:
    """The :data:`TOKENIZER_FILES` of ``source`` that exist, copied into ``out``."""
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            (Path(out) / name).write_bytes((Path(source) / name).read_bytes())


def arithmetic_prompt_ids(tokenizer, n: int, seed: int = 0, problems: str = "") -> list[list[int]]:
    """``n`` chat-templated prompts of the built-in task (``data=reasoning_gym``'s default tasks),
    or the first ``n`` of a problems file (``problems``: a machine without reasoning-gym reads
    what ``benchmarks/large_shapes.py --export-problems`` wrote)."""
    from ngrpo_lightning.config import compose
    from ngrpo_lightning.data import load_problems, reasoning_gym_problems, render_prompt

    if problems:
        problems = load_problems(problems, limit=n)
    else:
        problems = reasoning_gym_problems(compose([]).data.tasks, n, seed=seed)
    return [tokenizer(render_prompt(tokenizer, p.question), add_special_tokens=False)["input_ids"] for p in problems]


def best_of(fn, repeats: int) -> tuple[float, object]:
    """Fastest wall time of ``repeats`` calls (after one warm-up call) and the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def best_of_each(fns: dict, repeats: int) -> tuple[dict[str, float], dict[str, object]]:
    """``best_of`` for several contenders, their timed calls interleaved (a, b, a, b, ...) so that
    a slow spell of a shared machine does not fall on one contender only. Returns the fastest
    time and the last result of each."""
    outs = {name: fn() for name, fn in fns.items()}  # warm-up
    times = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name] = min(times[name], time.perf_counter() - t0)
    return times, outs


# Resident memory of this process (Linux: /proc/self/status; the peak is reset through clear_refs)
def rss_bytes() -> int:
    return _status_kb("VmRSS") * 1024


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter of this process (Linux >= 4.0); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        return True
    except OSError:
        return False


def peak_rss_bytes(was_reset: bool = True) -> int:
    """The peak since the last :func:`reset_peak` (``was_reset``), else since the process started."""
    if was_reset:
        return _status_kb("VmHWM") * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def print_table(rows: list[dict], columns: list[str]) -> None:
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


def write_json(name: str, rows: list[dict], path: str | Path | None = None, **meta) -> Path:
    """Write ``{"meta": ..., "rows": ...}`` to ``path`` (default ``results/<name>.json``)."""
    path = Path(path) if path else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta.update(
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        machine=platform.machine(),
        processor=platform.processor(),
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {path}")
    return path


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


# Processes a benchmark runs beside or under it
@contextlib.contextmanager
def background_load(n: int):
    """``n`` CPU-bound processes, killed on exit (also on Ctrl-C or an error)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def wait_watching_rss(proc: subprocess.Popen, interval_s: float = 1.0, limit_bytes: int | None = None) -> int:
    """Wait for ``proc``; the peak RSS of its process tree, sampled every ``interval_s``. A tree
    above ``limit_bytes`` is killed (the returned peak then exceeds the limit): a run that would
    exhaust the machine's memory ends as a failure of its own, not by the kernel's choice."""
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

    try:
        procs = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.Error:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    proc.wait()


def cpu_kind() -> dict:
    """The processor's name and the widest kernels it has (AMX, AVX-512, AVX2), for a record."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    kernels = "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return {"processor": name, "kernels": kernels, "avx512_bf16": "avx512_bf16" in flags}


def step_times(store: str) -> list[float]:
    """``time/step_s`` of the one run in an MLflow store, in step order."""
    from mlflow import MlflowClient

    client = MlflowClient(store)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = sorted(client.get_metric_history(run.info.run_id, "time/step_s"), key=lambda m: m.step)
    return [m.value for m in history]
