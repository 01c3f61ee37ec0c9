"""MLflow bookkeeping of a run: the logger, the resolved config in, a readable summary out."""

from __future__ import annotations

import fcntl
import math
import os
import re
import secrets
import shutil
import sqlite3
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from ngrpo_lightning.checkpoints.disk import disk_full
from ngrpo_lightning.checks import check_bool, check_number
from ngrpo_lightning.config import ConfigError
from ngrpo_lightning.tracking.code_version import code_tags


def mlflow_key(name: str) -> str:
    """A metric name MLflow accepts (``pass@4`` -> ``pass_at_4``; other refused characters -> ``_``)."""
    return re.sub(r"[^A-Za-z0-9_/. -]", "_", name.replace("@", "_at_"))


SQLITE = "sqlite:///"


def resolve_tracking_uri(uri: str) -> str:
    """Make a relative ``sqlite:///`` store absolute and create its folder."""
    if uri.startswith(SQLITE):
        path = Path(uri[len(SQLITE) :])
        path = path if path.is_absolute() else Path.cwd() / path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise _store_error(uri, f"cannot create the folder of the SQLite store {path.parent} ({err})") from err
        return SQLITE + str(path)
    return uri


def existing_store(uri: str) -> str | None:
    """``uri`` of a store that must already exist: a SQLite file (also given as a path, or the folder
    holding ``mlflow.db``) made absolute, a server's as it is; ``None`` where there is none."""
    if uri.startswith(("http://", "https://", "databricks")):
        return uri
    path = Path(uri[len(SQLITE) :] if uri.startswith(SQLITE) else uri).expanduser().absolute()
    if not uri.startswith(SQLITE) and path.is_dir():
        path = path / "mlflow.db"
    return SQLITE + str(path) if path.is_file() else None


def _store_error(uri: str, reason: str) -> ConfigError:
    return ConfigError(
        f"logger.tracking_uri={uri}: {reason}; set logger.tracking_uri to a store you can use, "
        "or logger=none to run without tracking"
    )


def check_tracking_store(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, naming ``logger.tracking_uri``, when the store cannot be used: an unwritable SQLite
    file, or a server that does not answer within ``timeout_s`` (MLflow's client would retry long)."""
    if uri.startswith(SQLITE):
        path = Path(uri[len(SQLITE) :])
        target = path if path.exists() else path.parent
        if not os.access(target, os.W_OK):
            raise _store_error(uri, f"the SQLite store {path} cannot be written ({target} is read-only)")
        try:
            sqlite3.connect(path).execute("PRAGMA user_version").close()
        except sqlite3.Error as err:
            raise _store_error(uri, f"cannot open the SQLite store {path} ({err})") from err
    elif uri.startswith(("http://", "https://")):
        health = uri.rstrip("/") + "/health"
        try:
            urllib.request.urlopen(health, timeout=timeout_s).close()
        except urllib.error.HTTPError as err:  # something answered, not as an MLflow server does
            raise _store_error(
                uri, f"{health} answered {err.code} {err.reason}: not an MLflow tracking server"
            ) from err
        except (OSError, ValueError) as err:  # URLError, timeouts, refused connections
            raise _store_error(uri, f"the tracking server does not answer ({err})") from err


@contextmanager
def store_lock(uri: str):
    """An exclusive file lock beside a SQLite store while it may be created or migrated: two runs never race."""
    if not uri.startswith(SQLITE):
        yield
        return
    with open(uri[len(SQLITE) :] + ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def default_run_name(cfg: DictConfig) -> str:
    """A readable run name: experiment, explorer, objective, seed and a short id."""
    parts = [str(cfg.get("experiment_name") or "run")]
    for group in ("explorer", "objective"):
        node = cfg.get(group)
        if node is not None:
            parts.append(str(node.get("name") or str(node.get("_target_") or group).rsplit(".", 1)[-1]))
    parts.append(f"seed{cfg.get('seed', 0)}")
    return "-".join(parts + [secrets.token_hex(3)])


class RunLogger(MLFlowLogger):
    """``MLFlowLogger`` whose run stays RUNNING until :meth:`close` ends it once (FINISHED, FAILED or
    KILLED): Lightning's ``finalize`` after each ``validate`` would mark it FINISHED before training."""

    _monitor = None

    def __init__(self, *args, tracking_uri: str, **kwargs):
        super().__init__(*args, tracking_uri=tracking_uri, **kwargs)
        self.tracking_uri = tracking_uri  # the store, said in summaries (MLFlowLogger keeps it private)

    def finalize(self, status: str = "success") -> None:
        pass  # the run ends in close()

    def monitor_system(self, interval_s: float, resume: bool = False) -> None:
        """Log ``system/*`` metrics into the run every ``interval_s`` seconds until :meth:`close`."""
        # imported here: MLflow is needed only by a run that logs to it (``logger=none`` runs without)
        from ngrpo_lightning.tracking.system_metrics import start_system_metrics

        self._monitor = start_system_metrics(self.run_id, self.tracking_uri, interval_s, resume)

    def close(self, status: str = "success") -> None:
        if self._monitor is not None:
            self._monitor.finish()  # its last samples are flushed while the run is still open
            self._monitor = None
        super().finalize(status)


def mlflow_ui_command(uri: str) -> str:
    """The command opening MLflow's UI on ``uri``: ``mlflow`` if the shell finds this venv's, else its full path."""
    here = Path(sys.executable).parent / "mlflow"
    found = shutil.which("mlflow")
    program = "mlflow" if found and (not here.exists() or Path(found).resolve() == here.resolve()) else str(here)
    return f"{program} ui --backend-store-uri {uri}"


NOTHING_RAN = "Nothing has run yet: free space, or give logger.tracking_uri= a store on another disk"


def build_logger(cfg: DictConfig, run_id: str | None = None, *, monitor: bool = False) -> RunLogger | None:
    """The MLflow logger of ``logger.*`` (``None`` for ``logger=none``): store checked and created
    under a lock, run started and tagged with the code (:mod:`.code_version`), before any model
    loads. ``run_id`` continues a run; ``monitor``: log system metrics when ``logger.system_metrics``."""
    if cfg.logger.name == "none":
        return None
    if cfg.logger.name != "mlflow":
        raise ConfigError(f"logger.name={cfg.logger.name!r} is unknown: allowed ['mlflow', 'none']")
    system_metrics = cfg.logger.get("system_metrics", False)
    interval = cfg.logger.get("system_metrics_interval_s", 10.0)
    check_bool("logger.system_metrics", system_metrics, ConfigError)
    try:
        check_number("logger.system_metrics_interval_s", interval, 0.0, low_open=True)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = resolve_tracking_uri(cfg.logger.tracking_uri)
    check_tracking_store(uri)
    artifacts = cfg.logger.artifact_location
    if artifacts is None and uri.startswith(SQLITE):
        artifacts = (Path(uri[len(SQLITE) :]).parent / "artifacts").as_uri()
    try:
        with store_lock(uri):  # the client opens (and may create) the store, then the experiment and the run
            logger = RunLogger(
                experiment_name=cfg.experiment_name,
                run_name=cfg.logger.run_name or default_run_name(cfg),
                tracking_uri=uri,
                artifact_location=artifacts,
                log_model=False,
                run_id=run_id,
                tags=code_tags() | dict(cfg.logger.get("tags") or {}),
            )
            client = logger.experiment
    except Exception as err:
        full = uri.startswith(SQLITE) and disk_full(err, Path(uri[len(SQLITE) :]), 0, "MLflow store", NOTHING_RAN)
        if full:
            raise full from err
        raise
    if run_id is not None:
        client.update_run(run_id, status="RUNNING")
    if monitor and system_metrics and rank_zero_only.rank == 0:
        logger.monitor_system(float(interval), resume=run_id is not None)
    return logger


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
    """A one-off MLflow run (``ngrpo eval``, ``ngrpo diagnose``): the flat config, ``metrics`` at step 0
    and ``files`` as artifacts. Returns the run id and summary lines (None and [] without logging)."""
    logger = build_logger(cfg)
    if logger is None:
        return None, []
    logger.log_hyperparams(flatten(OmegaConf.to_container(cfg, resolve=True)))
    logger.log_metrics({mlflow_key(k): v for k, v in metrics.items()}, step=0)
    for f in files:
        logger.experiment.log_artifact(logger.run_id, str(f))
    logger.close("success")
    run_name = cfg.logger.get("run_name")
    where = f"experiment {cfg.experiment_name!r}" + (f", run {run_name!r}" if run_name else "")
    return logger.run_id, [
        f"  MLflow run: {logger.run_id} ({where})",
        f"  view it:    {mlflow_ui_command(logger.tracking_uri)}",
    ]


def metric_history(logger, key: str) -> list[float]:
    """Values of one metric of the run, in step order (empty without MLflow)."""
    if logger is None:
        return []
    history = logger.experiment.get_metric_history(logger.run_id, key)
    return [m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))]


def _mean(xs):
    return sum(xs) / len(xs) if xs else math.nan


def _value(x: float) -> str:
    return "not run" if x is None or math.isnan(x) else f"{x:.3f}"


def _steps(n: int) -> str:
    return f"{n} step" + ("" if n == 1 else "s")


def summarize_run(trainer, logger, before, after, seconds: float, first_step: int = 0) -> dict:
    """A summary dict with a ``text`` field: validation accuracy before/after, first vs last rewards,
    where the run is stored. ``first_step``: where a resumed run started."""
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
    trained = _steps(summary["steps"] - first_step)
    lines = [
        f"Trained {trained} in {seconds / 60:.1f} min"
        + (f", from step {first_step} to {summary['steps']} (resumed)." if first_step else "."),
        f"  validation accuracy: {_value(summary['val_accuracy_before'])} before"
        f" -> {_value(summary['val_accuracy_after'])} after",
    ]
    if rewards:
        lines.append(
            f"  train reward: {summary['reward_first']:.3f} (first {_steps(k)})"
            f" -> {summary['reward_last']:.3f} (last {_steps(k)})"
        )
    if logger is not None:
        uri = logger.tracking_uri
        experiment = logger.experiment.get_experiment(logger.experiment_id).name  # a resumed run stays in its own
        lines += [
            f"  MLflow run: {logger.run_id} (experiment {experiment!r})",
            f"  view it:    {mlflow_ui_command(uri)}",
        ]
    summary["text"] = "\n".join(lines)
    return summary
