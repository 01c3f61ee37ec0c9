"""System metrics of a training run in MLflow (``logger.system_metrics``).

MLflow's own monitor samples CPU, memory, disk, network and (with NVML) each GPU; :class:`ProcessMemoryMonitor` adds
this process's memory (and its workers', torch's on CUDA), all under ``system/`` (one step per sample)."""

from __future__ import annotations

import resource

import psutil
import torch
from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

from ngrpo_lightning.compat.mlflow import add_monitor

MB = 1e6


class ProcessMemoryMonitor(BaseMetricsMonitor):
    """This process's memory: ``process_rss_megabytes`` (mean over a period), ``process_peak_rss_megabytes``,
    ``process_children_rss_megabytes`` and, on CUDA, ``torch_cuda_(peak_)allocated_megabytes``."""

    def __init__(self) -> None:
        super().__init__()
        self._process = psutil.Process()

    def collect_metrics(self) -> None:
        self.metrics["process_rss_megabytes"].append(self._process.memory_info().rss / MB)
        # ru_maxrss is in KiB on Linux: the peak between samples is not missed
        self.metrics["process_peak_rss_megabytes"].append(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB
        )
        children = 0
        for child in self._process.children(recursive=True):
            try:
                children += child.memory_info().rss
            except psutil.Error:  # ended between listing and reading
                pass
        self.metrics["process_children_rss_megabytes"].append(children / MB)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.metrics["torch_cuda_allocated_megabytes"].append(torch.cuda.memory_allocated() / MB)
            self.metrics["torch_cuda_peak_allocated_megabytes"].append(torch.cuda.max_memory_allocated() / MB)

    def aggregate_metrics(self) -> dict[str, float]:
        return {k: round(max(v) if "peak" in k else sum(v) / len(v), 1) for k, v in self.metrics.items() if v}


def start_system_metrics(
    run_id: str, tracking_uri: str, interval_s: float, resume: bool = False
) -> SystemMetricsMonitor:
    """A started monitor thread logging into ``run_id`` every ``interval_s`` seconds until the run ends
    or ``finish()``; ``resume`` continues an earlier part's step numbering."""
    monitor = SystemMetricsMonitor(
        run_id, sampling_interval=interval_s, resume_logging=resume, tracking_uri=tracking_uri
    )
    add_monitor(monitor, ProcessMemoryMonitor())
    monitor.start()
    return monitor
