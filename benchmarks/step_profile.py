"""Where one training step's time goes on its device: each phase's host time, the time its kernels
ran on the device, how many kernels it launched, and which of them and which host operations
took longest. ``harness.py profile`` and ``floor --profile`` add it to a run.

A training step names its phases for profilers (:mod:`ngrpo_lightning.phases`: ``ngrpo/rollout``,
``ngrpo/reward``, ``ngrpo/logprobs``, ``ngrpo/update``). :class:`StepProfile` runs
``torch.profiler`` over one step, from the end of the step before (so the step's rollout, made
when its batch arrives, is inside) to the end of its own, and :func:`phase_report` sums, for each
phase, the device's kernels and the host's operations that started inside its time range, on any
thread: a CUDA graph's replayed kernels and the backward's, run from autograd's own thread on a
GPU, included (a CPU run has no kernels, and its device columns stay empty).

``busy`` is the device's share of a phase's host time: near 1 the device is the limit (compute
or memory); far below, the host is (Python and kernel launches, or waits on the host such as
the reward's answer checking), and fewer, larger kernels are the lever. Profiling slows the host
by a few microseconds per operation, so the profiled step is left out of a benchmark's medians.

On a CPU, where the host's operations are the work, ``products_s`` is the time a phase spent in
its linear layers' matrix products (their own time; attention's are left out) and
``products_gflops`` the rate they ran at there (FLOPs from the operands' shapes the profiler
records): weights and activations as the step leaves them in memory, not warm in the caches as a
product timed alone. Set against the floor's dense rate it says how much of a phase's excess over
its floor is the products' own rate and how much is everything else.
"""

from __future__ import annotations

import gzip
import shutil
from collections import Counter
from math import prod
from pathlib import Path

import lightning as L
import torch
from torch.autograd import DeviceType

from ngrpo_lightning.phases import PREFIX

TOP = 6  # kernels and host operations listed per phase
# a linear layer's products on a CPU, aten's and oneDNN's (the backend's packed and as-they-lie ones); attention's
# batched products are left out: their time is reading the cache, not multiplying
PRODUCTS = frozenset({"aten::mm", "aten::addmm", "aten::addmm_", "mkldnn::_linear_pointwise"})


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
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)  # products' FLOPs
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


def product_flops(name: str, shapes: list) -> int:
    """2 x M x K x N of a matrix product from its operands' shapes: ``[M, K] x [K, N]`` (``mm``; ``addmm`` after
    the added term) or oneDNN's ``x [..., K]`` times ``weight [N, K]``; 0 where the shapes were not recorded."""
    if name in ("aten::addmm", "aten::addmm_"):
        shapes = shapes[1:]
    if len(shapes) < 2 or not shapes[0] or not shapes[1]:
        return 0
    a, b = shapes[0], shapes[1]
    return 2 * prod(a) * (b[0] if name == "mkldnn::_linear_pointwise" else b[-1])


def phase_report(events) -> dict[str, dict]:
    """``phase -> {host_s, device_s, busy, kernels, graph_launches, calls, top_kernels, top_host_ops,
    products_s, products_gflops}``
    for every ``ngrpo/`` range among a profiler's ``events`` (ranges of one name summed). Times in
    seconds; the top lists are ``[name, seconds, count]``, longest first (a host operation's time is
    its own, its callees' left out). ``products_s`` / ``products_gflops``: the host's linear products
    (:data:`PRODUCTS`) and their rate, ``None`` in a phase that ran kernels on a device (there the host
    only launches them).

    Every other event belongs to the innermost phase whose time range holds its start, whatever
    thread it ran on: the kernels a CUDA graph's replay runs (no host operation launches them, so
    ``FunctionEvent.kernels`` of the range's operations leaves them out), the backward's operations
    (autograd runs a GPU's backward on a thread of its own) and their kernels. A phase on a GPU
    ends by waiting for its kernels (:mod:`ngrpo_lightning.phases`), so a kernel that starts
    inside its range is its own; work that another thread overlaps with it (rollouts made ahead)
    counts in it too. A range is the host's: the copy a GPU's trace draws around the range's kernels
    on the device's timeline is neither a call nor a kernel."""
    ranges = sorted(  # the host's: on a GPU each range is also drawn on the device's timeline, around its kernels
        (e.time_range.start, e.time_range.end, e.name[len(PREFIX) :])
        for e in events
        if e.name.startswith(PREFIX) and e.device_type == DeviceType.CPU
    )
    report: dict[str, dict] = {}
    for _, _, name in ranges:
        report.setdefault(name, {"host_s": 0.0, "calls": 0, "_sums": tuple(Counter() for _ in range(4)), "_flops": 0})
    for start, end, name in ranges:
        report[name]["host_s"] += (end - start) / 1e6
        report[name]["calls"] += 1
    for event in events:
        if event.name.startswith(PREFIX):
            continue
        name = _innermost(ranges, event.time_range.start)
        if name is None:
            continue
        kernel_us, kernel_n, host_us, host_n = report[name]["_sums"]
        if event.device_type == DeviceType.CPU:
            host_us[event.name] += event.self_cpu_time_total
            host_n[event.name] += 1
            if event.name in PRODUCTS:
                report[name]["_flops"] += product_flops(event.name, event.input_shapes or [])
        else:  # a kernel, copy or fill on the device
            kernel_us[event.name] += event.time_range.elapsed_us()
            kernel_n[event.name] += 1
    for entry in report.values():
        kernels, counts, host, calls = entry.pop("_sums")
        entry["device_s"] = sum(kernels.values()) / 1e6
        entry["busy"] = entry["device_s"] / entry["host_s"] if entry["host_s"] > 0 else 0.0
        entry["kernels"] = sum(counts.values())
        entry["graph_launches"] = calls["cudaGraphLaunch"]
        entry["top_kernels"] = [[k[:90], us / 1e6, counts[k]] for k, us in kernels.most_common(TOP)]
        entry["top_host_ops"] = [[k[:90], us / 1e6, calls[k]] for k, us in host.most_common(TOP)]
        flops, products_s = entry.pop("_flops"), sum(host[k] for k in PRODUCTS) / 1e6
        on_host = entry["kernels"] == 0 and products_s > 0
        entry["products_s"] = products_s if on_host else None
        entry["products_gflops"] = flops / products_s / 1e9 if on_host and flops else None
    return report


def _innermost(ranges: list[tuple[float, float, str]], t: float) -> str | None:
    """The phase of the latest-starting range (sorted by start) that holds time ``t``: a nested
    range starts after the one around it."""
    inside = None
    for start, end, name in ranges:
        if start > t:
            break
        if t <= end:
            inside = name
    return inside


def write_trace(profiler, path: Path) -> None:
    """The profiler's Chrome trace at ``path`` (gzipped for a ``.gz`` name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = path.with_suffix("") if path.suffix == ".gz" else path
    profiler.export_chrome_trace(str(plain))
    if plain != path:
        with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        plain.unlink()


PROFILE_COLUMNS = ["host_s", "device_s", "busy", "kernels", "graphs", "longest", "products_s", "products_gflops"]
PROFILE_LEGEND = "device: its kernels' time; busy: device / host; products: a CPU's linear ones"  # the columns


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
                "graphs": entry["graph_launches"],
                "longest": f"{top[0][:48]} {top[1]:.4f} s" if top else "",
                "products_s": _round(entry.get("products_s"), 3),
                "products_gflops": _round(entry.get("products_gflops"), 1),
            }
        )
    return rows


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)
