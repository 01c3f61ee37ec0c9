"""MLflow bookkeeping of a run: the resolved config in, a readable summary out."""

from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf


def flatten(cfg: dict, prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists kept as their string form)."""
    out = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def log_config(logger, cfg: DictConfig) -> None:
    """Log the resolved config as flat params and as ``config.yaml``."""
    container = OmegaConf.to_container(cfg, resolve=True)
    logger.log_hyperparams(flatten(container))
    logger.experiment.log_text(logger.run_id, OmegaConf.to_yaml(cfg), "config.yaml")


def log_report_run(cfg: DictConfig, metrics: dict[str, float], files) -> tuple[str | None, list[str]]:
    """A one-off MLflow run (``ngrpo eval``, ``ngrpo diagnose``): the flat config, ``metrics`` at
    step 0 (names made MLflow-safe) and ``files`` as artifacts. Returns the run id and the
    summary lines that say how to open it (None and no lines when logging is off)."""
    from .build import build_logger
    from .evaluate import mlflow_key

    logger = build_logger(cfg)
    if logger is None:
        return None, []
    logger.log_hyperparams(flatten(OmegaConf.to_container(cfg, resolve=True)))
    logger.log_metrics({mlflow_key(k): v for k, v in metrics.items()}, step=0)
    for f in files:
        logger.experiment.log_artifact(logger.run_id, str(f))
    logger.finalize("success")
    run_name = cfg.logger.get("run_name")
    where = f"experiment {cfg.experiment_name!r}" + (f", run {run_name!r}" if run_name else "")
    return logger.run_id, [f"  MLflow run: {logger.run_id} ({where})",
                           f"  view it:    mlflow ui --backend-store-uri {logger._tracking_uri}"]


def metric_history(logger, key: str) -> list[float]:
    """Values of one metric of the run, in step order (empty without MLflow)."""
    if logger is None:
        return []
    history = logger.experiment.get_metric_history(logger.run_id, key)
    return [m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))]


def _mean(xs):
    return sum(xs) / len(xs) if xs else math.nan


def summarize_run(trainer, logger, before, after, seconds: float) -> dict:
    """A summary dict with a ``text`` field: validation accuracy before/after, reward of the
    first vs last steps, where the run is stored and how to look at it."""
    acc = lambda res: res[0].get("val/accuracy", math.nan) if res else math.nan  # noqa: E731
    rewards = metric_history(logger, "train/reward")
    k = max(1, len(rewards) // 3)
    summary = {
        "steps": trainer.global_step,
        "seconds": seconds,
        "val_accuracy_before": acc(before),
        "val_accuracy_after": acc(after),
        "reward_first": _mean(rewards[:k]),
        "reward_last": _mean(rewards[-k:]),
        "run_id": getattr(logger, "run_id", None),
    }
    lines = [
        f"Trained {summary['steps']} steps in {seconds / 60:.1f} min.",
        f"  validation accuracy: {summary['val_accuracy_before']:.3f} before -> {summary['val_accuracy_after']:.3f} after",
    ]
    if rewards:
        lines.append(f"  train reward: {summary['reward_first']:.3f} (first {k} steps) -> {summary['reward_last']:.3f} (last {k} steps)")
    if logger is not None:
        uri = logger._tracking_uri
        lines += [f"  MLflow run: {logger.run_id} (experiment {logger._experiment_name!r})", f"  view it:    mlflow ui --backend-store-uri {uri}"]
    summary["text"] = "\n".join(lines)
    return summary
