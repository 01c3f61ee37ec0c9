"""MLflow internals the package uses, tested on mlflow 3.17.

MLflow's system metrics monitor samples the monitors in its ``monitors`` list and has no API to add one: the run's
own (``tracking/system_metrics.py``: this process's memory) goes into that list (:func:`add_monitor`).
"""

from __future__ import annotations

from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

from ngrpo_lightning.compat import Library

TESTED = {"mlflow": ">=3.17,<3.18", "mlflow-skinny": ">=3.17,<3.18"}
MLFLOW = Library("mlflow", TESTED)
MLFLOW.warn_if_untested()

__all__ = ["TESTED", "add_monitor"]


def add_monitor(system: SystemMetricsMonitor, monitor) -> None:
    """Have ``system`` (a ``SystemMetricsMonitor`` not yet started) sample ``monitor`` too, under ``system/``."""
    monitors = MLFLOW.attribute(system, "monitors")
    if not isinstance(monitors, list):
        raise MLFLOW.error("SystemMetricsMonitor.monitors as a list")
    monitors.append(monitor)
