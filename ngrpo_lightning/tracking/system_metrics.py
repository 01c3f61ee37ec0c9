"""System metrics of a training run in MLflow (``logger.system_metrics``).

MLflow's own monitor samples CPU utilisation, system memory, disk and network and, where NVML
answers (``nvidia-ml-py``, an NVIDIA driver), each GPU's memory and utilisation. It knows
nothing of this process, so :class:`ProcessMemoryMonitor` adds what a user needs to see where
the run's memory goes without a profiler: the trainer's resident memory (and its peak), its
worker processes' (verifier pool, vLLM engine), and on CUDA what torch itself holds.
Everything is logged under ``system/`` with MLflow's step counter (one step per sample).
"""

from __future__ import annotations

import resource

import psutil
import torch
from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

MB = 1e6


class ProcessMemoryMonitor(BaseMetricsMonitor):
    """This process's memory: ``process_rss_megabytes`` (mean over the samples of one logging
    period), ``process_peak_rss_megabytes`` (the process's high-water mark so far),
    ``process_children_rss_megabytes`` (all its descendants) and, on CUDA,
    ``torch_cuda_allocated_megabytes`` / ``torch_cuda_peak_allocated_megabytes``."""

    def __init__(self) -> None:
        super().__init__()
        self._process = psutil.Process()

    def collect_metrics(self) -> None:
        self._metrics["process_rss_megabytes"].append(self._process.memory_info().rss / MB)
        # ru_maxrss is in KiB on Linux: the peak between samples is not missed
        self._metrics["process_peak_rss_megabytes"].append(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB
        )
        children = 0
        for child in self._process.children(recursive=True):
            try:
                children += child.memory_info().rss
            except psutil.Error:  # ended between listing and reading
                pass
        self._metrics["process_children_rss_megabytes"].append(children / MB)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._metrics["torch_cuda_allocated_megabytes"].append(torch.cuda.memory_allocated() / MB)
            self._metrics["torch_cuda_peak_allocated_megabytes"].append(torch.cuda.max_memory_allocated() / MB)

    def aggregate_metrics(self) -> dict[str, float]:
        return {k: round(max(v) if "peak" in k else sum(v) / len(v), 1) for k, v in self._metrics.items() if v}


def start_system_metrics(
    run_id: str, tracking_uri: str, interval_s: float, resume: bool = False
) -> SystemMetricsMonitor:
    """A started monitor thread logging into ``run_id`` every ``interval_s`` seconds; it stops by
    itself when the run ends, or with ``finish()``. ``resume`` continues the step numbering of an
    earlier part of the run."""
    monitor = SystemMetricsMonitor(
        run_id, sampling_interval=interval_s, resume_logging=resume, tracking_uri=tracking_uri
    )
    monitor.monitors.append(ProcessMemoryMonitor())
    monitor.start()
    return monitor
