"""``ngrpo compare [sweep=<id>] [experiments=[...]] [runs=[...]]``: read the runs, build the
report (markdown, JSON, figures), write it to ``output_dir`` and log it as an MLflow run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ngrpo_lightning.commands.compare.curves import plot_compute
from ngrpo_lightning.commands.compare.report import arm_tables, markdown, plot_curves, plot_pass_at_k
from ngrpo_lightning.commands.compare.runs import broken_verifier_runs, budget_mismatches, load_run, select_runs
from ngrpo_lightning.commands.compare.sequential import plot_history
from ngrpo_lightning.config import DEFAULT_TRACKING_URI, ConfigError
from ngrpo_lightning.tracking.logger import existing_store, log_report_run


def check_compare_settings(cfg: DictConfig) -> None:
    """``level``, ``power`` in (0, 1), ``detect`` in (0, 1] (0.05: 5 points), ``draws``, ``resamples`` ints > 0."""
    for key, low, high in (("level", 0, 1), ("power", 0, 1), ("detect", 0, 1)):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high + (key == "detect"):
            closed = "]" if key == "detect" else ")"
            raise ConfigError(
                f"{key}={value!r} must be a number in ({low}, {high}{closed} (a fraction, 0.05 = 5 points)"
            )
    for key in ("draws", "resamples"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r} must be a positive integer")


def run_compare(cfg: DictConfig) -> dict:
    """The comparison of the runs ``cfg`` names; returns ``{"tables", "text", "files"}``."""
    from mlflow import MlflowClient

    check_compare_settings(cfg)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one small file per run
    t0 = time.perf_counter()
    store = cfg.store or cfg.logger.get("tracking_uri") or DEFAULT_TRACKING_URI
    readable = existing_store(store)  # read, never created here
    if readable is None:
        raise ConfigError(
            f"store={store}: no MLflow store there (no run has logged to it); give store=<the runs' store>"
        )
    client = MlflowClient(readable)
    found = select_runs(client, cfg.sweep, list(cfg.experiments), list(cfg.runs), store)
    if cfg.finished_only:
        found = [r for r in found if r.info.status == "FINISHED"]
    runs = [load_run(client, r) for r in found]
    broken = broken_verifier_runs(runs)
    runs = [r for r in runs if all(r is not b for b, _ in broken)]
    arms = sorted({r.arm for r in runs})
    if len(arms) < 2:
        raise ConfigError(
            f"a comparison needs two arms; the runs named ({len(runs)} finished) form {len(arms)}: {arms}. "
            "Name more runs, experiments or a sweep with several arms"
        )
    warnings = budget_mismatches(runs) + [
        f"left out: {r.arm} seed {r.seed} (MLflow run {r.run_id}): {100 * share:.0f}% of its answers failed in the "
        "verifier itself (reward/error_frac), a broken check rather than a result; run it again"
        for r, share in broken
    ]
    tables = arm_tables(runs, cfg)
    what = f"sweep {cfg.sweep}" if cfg.sweep else ", ".join([*cfg.experiments, *cfg.runs])
    header = f"# Comparison: {what} ({len(runs)} runs, {len(arms)} arms)"
    text = markdown(tables, runs, warnings, header)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / n for n in ("compare.md", "compare.json", "curves_step.png", "curves_time.png", "compute.png")]
    replaced = _earlier_report(files[0])
    files[0].write_text(text)
    fits = {axis: {arm: f and f.as_dict() for arm, f in per_arm.items()} for axis, per_arm in tables["fits"].items()}
    record = {
        "tables": tables | {"fits": fits},
        "warnings": warnings,
        "runs": [vars(r) | {"pass_at_k": None} for r in runs],
    }
    files[1].write_text(json.dumps(record, indent=1, default=str))
    plot_curves(runs, files[2], x="step")
    plot_curves(runs, files[3], x="minutes")
    plot_compute(runs, tables["fits"], files[4])
    if tables["ks"]:
        files.append(out / "pass_at_k.png")
        plot_pass_at_k(tables, files[-1])
    if any(p["history"] for p in tables["paired"]):
        files.append(out / "seeds.png")
        plot_history(tables["paired"], tables["detect"], files[-1])
    metrics = {f"compare/{arm}/{m}": v[0] for arm, info in tables["arms"].items() for m, v in info["final"].items()}
    if cfg.store and cfg.logger.get("tracking_uri") == DEFAULT_TRACKING_URI:
        cfg = OmegaConf.merge(cfg, {"logger": {"tracking_uri": cfg.store}})  # the report beside the runs it read
    _, lines = log_report_run(cfg, {**metrics, "compare/seconds": time.perf_counter() - t0}, files)
    footer = [f"Report: {files[0]} (figures beside it)", *replaced, *lines]
    return {"tables": tables, "warnings": warnings, "text": text + "\n" + "\n".join(footer), "files": files}


def _earlier_report(path: Path) -> list[str]:
    """A line saying which report ``path`` held before this one replaces it (none if it held none)."""
    if not path.is_file():
        return []
    first = path.read_text(errors="replace").split("\n", 1)[0].removeprefix("# ")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
    return [
        f"  replaced:   the report written there at {when} ({first}); each report is also its own MLflow "
        "run, and output_dir=<another folder> keeps both on disk"
    ]
