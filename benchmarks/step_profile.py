"""Where one training step's time goes on its device: each phase's host time, the time its kernels
ran on the device, how many kernels it launched, and which of them and which host operations
took longest. ``benchmarks/large_shapes.py --profile`` adds it to each run.

A training step names its phases for profilers (:mod:`ngrpo_lightning.phases`: ``ngrpo/rollout``,
``ngrpo/reward``, ``ngrpo/logprobs``, ``ngrpo/update``). :class:`StepProfile` runs
``torch.profiler`` over one step, from the end of the step before (so the step's rollout, made
when its batch arrives, is inside) to the end of its own, and :func:`phase_report` sums, for each
phase, the kernels launched by every operation inside it (``FunctionEvent.kernels``, a GPU's;
a CPU run has none, and its device columns stay empty).

``busy`` is the device's share of a phase's host time: near 1 the device is the limit (compute
or memory); far below, the host is (Python and kernel launches, or waits on the host such as
the reward's answer checking), and fewer, larger kernels are the lever. Profiling slows the host
by a few microseconds per operation, so the profiled step is left out of a benchmark's medians.
"""

from __future__ import annotations

import gzip
import shutil
from collections import Counter
from pathlib import Path

import lightning as L
import torch

from ngrpo_lightning.phases import PREFIX

TOP = 6  # kernels and host operations listed per phase


class StepProfile(L.Callback):
    """Profile training step ``step`` (0-based, counted over the fit's training batches, epochs
    included; at least 1: step 0 warms up); its :func:`phase_report` is :attr:`report`
    afterwards. ``trace``: also write the step's Chrome trace there (gzipped for a ``.gz`` name)."""

    def __init__(self, step: int = 1, trace: str | Path | None = None):
        if step < 1:
            raise ValueError(f"step={step}: profile a step after the first (its start is the end of the one before)")
        self.step, self.trace = step, trace
        self.report: dict | None = None
        self._profiler, self._ended = None, 0  # training batches ended so far (batch_idx restarts each epoch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        ended, self._ended = self._ended, self._ended + 1
        if ended == self.step - 1:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
        elif ended == self.step and self._profiler is not None:
            self._finish()

    def on_train_end(self, trainer, pl_module) -> None:
        if self._profiler is not None:  # the run ended inside the window
            self._finish()

    def _finish(self) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self.report = phase_report(profiler.events())
        if self.trace:
            write_trace(profiler, Path(self.trace))


def phase_report(events) -> dict[str, dict]:
    """``phase -> {host_s, device_s, busy, kernels, calls, top_kernels, top_host_ops}`` for every
    ``ngrpo/`` range among a profiler's ``events`` (ranges of one name summed; kernels counted
    under every operation inside, however deep). Times in seconds; the top lists are
    ``[name, seconds, count]``, longest first (a host operation's time is its own, its callees'
    left out)."""
    report: dict[str, dict] = {}
    for event in events:
        if not event.name.startswith(PREFIX):
            continue
        name = event.name[len(PREFIX) :]
        entry = report.setdefault(name, {"host_s": 0.0, "calls": 0, "_sums": tuple(Counter() for _ in range(4))})
        entry["host_s"] += event.time_range.elapsed_us() / 1e6
        entry["calls"] += 1
        for total, part in zip(entry["_sums"], _inside(event)):
            total.update(part)
    for entry in report.values():
        kernels, counts, host, calls = entry.pop("_sums")
        entry["device_s"] = sum(kernels.values()) / 1e6
        entry["busy"] = entry["device_s"] / entry["host_s"] if entry["host_s"] > 0 else 0.0
        entry["kernels"] = sum(counts.values())
        entry["top_kernels"] = [[k[:90], us / 1e6, counts[k]] for k, us in kernels.most_common(TOP)]
        entry["top_host_ops"] = [[k[:90], us / 1e6, calls[k]] for k, us in host.most_common(TOP)]
    return report


def _inside(root) -> tuple[Counter, Counter, Counter, Counter]:
    """``root`` and below: kernel time (us) and count by name, host self-time (us) and calls by
    operation. ``root``'s own kernels count: a launch outside any operation (a CUDA graph's
    replay) is the range's."""
    kernel_us, kernel_n, host_us, host_n = Counter(), Counter(), Counter(), Counter()
    stack = [root]
    while stack:
        event = stack.pop()
        for kernel in event.kernels:
            kernel_us[kernel.name] += kernel.duration
            kernel_n[kernel.name] += 1
        if not event.name.startswith(PREFIX):  # a nested phase is reported as its own
            host_us[event.name] += event.self_cpu_time_total
            host_n[event.name] += 1
        stack.extend(event.cpu_children)
    return kernel_us, kernel_n, host_us, host_n


def write_trace(profiler, path: Path) -> None:
    """The profiler's Chrome trace at ``path`` (gzipped for a ``.gz`` name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = path.with_suffix("") if path.suffix == ".gz" else path
    profiler.export_chrome_trace(str(plain))
    if plain != path:
        with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        plain.unlink()


def phase_rows(label: dict, report: dict[str, dict]) -> list[dict]:
    """Table rows (one per phase, ``label``'s columns first) of a :func:`phase_report`."""
    rows = []
    for name, entry in report.items():
        # the longest kernel on a device; on a CPU (no kernels) the longest host operation
        top = (entry["top_kernels"] or entry["top_host_ops"] or [None])[0]
        rows.append(
            {
                **label,
                "phase": name,
                "host_s": round(entry["host_s"], 4),
                "device_s": round(entry["device_s"], 4),
                "busy": round(entry["busy"], 3),
                "kernels": entry["kernels"],
                "longest": f"{top[0][:48]} {top[1]:.4f} s" if top else "",
            }
        )
    return rows
