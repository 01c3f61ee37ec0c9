"""Sweeps: ``ngrpo train --multirun experiment=grpo,ngrpo,stht seed=0,1,2`` on Hydra's launchers.

Hydra expands the overrides into one job per combination for the ``hydra/launcher`` (``basic``,
``joblib``, ``submitit_slurm``; docs/sweeps.md). Each job is an ordinary training run:

* its folder is ``multirun/<sweep>/<job overrides>``, stable across invocations;
* its MLflow run is tagged :data:`TAGS` (``ngrpo.arm``: the swept values but the seed, or ``<explorer> x <objective>``);
* a failure is recorded and the sweep goes on, except after a full disk (later jobs not started);
* re-running the sweep (``sweep=<id>``) skips finished jobs and resumes the others (``resume=last``)."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import re
import shlex
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from ngrpo_lightning import schema
from ngrpo_lightning.build.components import check_config
from ngrpo_lightning.checkpoints.disk import DiskFull
from ngrpo_lightning.config import ConfigError, compose, config_dir, normalize_overrides

log = logging.getLogger(__name__)

JOB_FILE = "sweep_job.json"
TAGS = ("ngrpo.sweep", "ngrpo.arm", "ngrpo.seed", "ngrpo.explorer", "ngrpo.objective")
_ROOT_KEYS = ("sweep=", "output_dir=", "hydra.", "hydra/")  # sweep-level overrides, not a job's identity


def run_sweep(overrides: list[str], train: Callable[[DictConfig], dict], root: str | Path = "multirun") -> dict:
    """Run every combination of ``overrides`` as its own run of ``train``; returns ``{"sweep", "dir",
    "jobs": [the sweep_job.json records], "text"}``. The process's logging is restored afterwards."""
    import hydra

    sweep = next((o.split("=", 1)[1] for o in overrides if o.startswith("sweep=")), None)
    sweep = sweep or time.strftime("sweep-%Y%m%d-%H%M%S")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", sweep):
        raise ConfigError(f"sweep={sweep!r}: a sweep id is letters, digits, '.', '_' and '-'")
    sweep_dir = Path(root) / sweep
    args = [o for o in normalize_overrides(overrides) if not o.startswith("sweep=")]
    swept = swept_keys(args)
    check_jobs(args)  # every job's config, before any job trains
    args += [
        f"sweep={sweep}",
        f"hydra.sweep.dir={sweep_dir}",
        "hydra.sweep.subdir='${ngrpo_folder:${hydra.job.override_dirname}}'",
        "hydra.job.config.override_dirname.exclude_keys=[sweep,output_dir,logger.tracking_uri,logger.artifact_location]",
    ]
    OmegaConf.register_new_resolver("ngrpo_folder", lambda dirname: folder_name(dirname, swept), replace=True)

    schema.register()  # the typed nodes conf/config.yaml places

    disk_full: list[str] = []  # what a job's checkpoint said when it found the disk full

    @hydra.main(config_path=str(config_dir()), config_name="config", version_base=None)
    def job(cfg: DictConfig) -> dict:
        return run_job(cfg, swept, train, disk_full)

    argv, root_logger = sys.argv, logging.getLogger()
    handlers, level = list(root_logger.handlers), root_logger.level
    sys.argv = ["ngrpo-train", "--multirun", *args]
    try:
        job()
    except SystemExit as err:  # Hydra exits on composition errors; say what failed instead
        if err.code:
            raise ConfigError(f"the sweep could not start (Hydra's message above); overrides: {overrides}") from err
    finally:
        sys.argv = argv
        root_logger.handlers[:], root_logger.level = handlers, level
    jobs = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob(f"*/{JOB_FILE}"))]
    store = next((o.split("=", 1)[1] for o in args if o.startswith("logger.tracking_uri=")), None)
    text = sweep_table(sweep, sweep_dir, jobs, store)
    return {"sweep": sweep, "dir": str(sweep_dir), "jobs": jobs, "text": text}


def folder_name(overrides: str, swept: set[str] = frozenset()) -> str:
    """A job's folder: its overrides, ``swept`` keys first, odd characters replaced, past 100 cut and checksummed."""
    items = re.split(r",(?=[A-Za-z_+~][\w.+~/-]*=)", overrides) if overrides else []  # a list value keeps its commas
    items = sorted(items, key=lambda item: item.split("=", 1)[0].lstrip("+~") not in swept)  # stable: Hydra's order
    name = re.sub(r"[^A-Za-z0-9._,=+-]", "_", ",".join(items)) or "defaults"
    return name if len(name) <= 100 else f"{name[:90]}-{zlib.crc32(name.encode()):08x}"


def swept_keys(overrides: list[str]) -> set[str]:
    """The keys an invocation sweeps (``seed=0,1`` -> ``seed``), as Hydra's parser reads them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:  # noqa: BLE001 - Hydra's parse errors carry the position
        raise ConfigError(f"cannot read the sweep's overrides {overrides}: {err}") from err
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


def check_jobs(args: list[str]) -> None:
    """Check every job's config before any job trains: a wrong key or value refuses the whole sweep, naming the job."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def quoted(value: str) -> str:
        return value if re.fullmatch(r"[\w./:@+-]*", value) else "'" + value.replace("'", "\\'") + "'"

    choices = [
        [f"{o.get_key_element()}={quoted(v)}" for v in o.sweep_string_iterator()]
        if o.is_sweep_override()
        else [o.input_line]
        for o in OverridesParser.create().parse_overrides(args)
    ]
    for job in itertools.product(*choices):
        try:
            check_config(compose(list(job)))
        except ConfigError as err:
            swept = [o for o, options in zip(job, choices) if len(options) > 1]
            raise ConfigError(f"the sweep's job {' '.join(swept) or '(the only one)'}: {err}") from err


def run_job(cfg: DictConfig, swept: set[str], train: Callable[..., dict], disk_full: list[str] | None = None) -> dict:
    """One job of a sweep: skip it if finished, resume it if it has a checkpoint, train it otherwise; never raise.
    ``disk_full``: the sweep's record of a full disk (appended to); while it holds one, jobs are not started."""
    disk_full = [] if disk_full is None else disk_full
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir)
    job_overrides = [o for o in hc.overrides.task if not o.startswith(_ROOT_KEYS)]
    explorer = str(cfg.explorer.get("name") or cfg.explorer.get("_target_"))
    objective = str(cfg.objective.get("name") or cfg.objective.get("_target_"))
    arm = [o for o in job_overrides if o.split("=", 1)[0].lstrip("+~") in swept - {"seed"}]
    record_path = out / JOB_FILE
    before = json.loads(record_path.read_text()) if record_path.is_file() else {}
    record = {"overrides": job_overrides, "arm": ",".join(arm) or f"{explorer} x {objective}", "seed": int(cfg.seed)}
    if before.get("status") == "finished":
        log.info(
            "sweep %s: %s, seed %s already finished (MLflow run %s): skipped",
            cfg.sweep, record["arm"], record["seed"], before["run_id"],
        )  # fmt: skip
        return before
    if disk_full:  # it would fail at its first checkpoint, its steps lost
        record.update(status="not started", error=f"DiskFull: an earlier job's {disk_full[0]}")
        with contextlib.suppress(OSError):  # the disk is full: the table reports the job all the same
            record_path.parent.mkdir(parents=True, exist_ok=True)
            record_path.write_text(json.dumps(record, indent=1))
        return record
    OmegaConf.resolve(cfg)
    resume = (out / "checkpoints" / "last.ckpt").exists()
    with open_dict(cfg):
        cfg.output_dir = str(out)
        cfg.resume = "last" if resume else None
        if not resume:  # a first attempt that died before its first checkpoint left nothing to keep
            cfg.overwrite = True
        cfg.logger.tags = {
            "ngrpo.sweep": cfg.sweep,
            "ngrpo.arm": record["arm"],
            "ngrpo.seed": str(cfg.seed),
            "ngrpo.explorer": explorer,
            "ngrpo.objective": objective,
        }
    record.update(status="running", resumed=resume, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    out.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(record, indent=1))
    try:
        summary = train(cfg, command=shlex.join(["ngrpo", "train", *job_overrides]))  # what retrains this job
        record.update(status="finished", run_id=summary.get("run_id"), steps=summary.get("steps"))
        for key in ("val_accuracy_before", "val_accuracy_after", "reward_first", "reward_last", "seconds"):
            if key in summary:
                record[key] = summary[key]
    except Exception as err:  # noqa: BLE001 - one failed arm must not stop the sweep
        log.error("sweep %s: %s (seed %s) failed: %s", cfg.sweep, record["arm"], cfg.seed, err)
        record.update(status="failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        if isinstance(err, DiskFull):
            disk_full.append(err.subject)
    with contextlib.suppress(OSError):  # a full disk: the record in memory still reaches the table
        record_path.write_text(json.dumps(record, indent=1))
    return record


def sweep_table(sweep: str, sweep_dir: Path, jobs: list[dict], store: str | None = None) -> str:
    """A markdown table of a sweep's jobs, what to do about failed ones, and the compare command (with ``store``)."""
    lines = [
        f"Sweep {sweep} ({len(jobs)} runs) in {sweep_dir}:",
        "",
        "| arm | seed | status | val accuracy before -> after | MLflow run |",
        "|---|---:|---|---|---|",
    ]
    for j in sorted(jobs, key=lambda j: (j["arm"], j["seed"])):
        acc = ""
        if "val_accuracy_after" in j:  # a run without validation problems: NaN, "not run" as its summary says
            before, after = (j.get(k, math.nan) for k in ("val_accuracy_before", "val_accuracy_after"))
            acc = " -> ".join("not run" if math.isnan(v) else f"{v:.3f}" for v in (before, after))
        status = j["status"] + (f": {j['error'][:80]}" if j.get("error") else "")
        lines.append(f"| {j['arm']} | {j['seed']} | {status} | {acc} | {j.get('run_id') or ''} |")
    failed = [j for j in jobs if j["status"] != "finished"]
    if failed:
        on_settings = sum(str(j.get("error", "")).startswith("ConfigError") for j in failed)
        full = any(str(j.get("error", "")).startswith("DiskFull") for j in failed)
        lines += [
            "",
            f"{len(failed)} run(s) did not finish: run the same command with sweep={sweep} to try them again"
            " (finished runs are skipped, interrupted ones resume)"
            + (f"; {on_settings} of them on a setting, which must change first" if on_settings else "")
            + ("; the disk of the checkpoints is full: free space first" if full else ""),
        ]
    lines += ["", f"compare the arms: ngrpo compare sweep={sweep}" + (f" store={store}" if store else "")]
    return "\n".join(lines)
