"""``ngrpo train``: one training job on a composed config (validate, fit, validate again).

Apart from :mod:`ngrpo_lightning.commands.cli` so the command line's cheap paths answer before torch
and Lightning load (``from ngrpo_lightning.commands.cli import train`` resolves on first use)."""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from ngrpo_lightning.build.components import build_pass_at_k
from ngrpo_lightning.build.data import build_problems
from ngrpo_lightning.build.run import assemble, prepare_process
from ngrpo_lightning.build.trainer import build_trainer
from ngrpo_lightning.checkpoints.export import (
    export_checkpoint,
    is_own_export,
    log_exported,
    model_card,
    save_hf_model,
)
from ngrpo_lightning.checkpoints.run import check_resume, checkpoint_meta, claim_output_dir, resolve_resume
from ngrpo_lightning.checkpoints.safe_load import load_checkpoint
from ngrpo_lightning.config import ConfigError
from ngrpo_lightning.tracking.components import log_components
from ngrpo_lightning.tracking.console import header, quiet_libraries
from ngrpo_lightning.tracking.logger import build_logger, flatten, log_config, summarize_run
from ngrpo_lightning.training.interrupt import StopOnInterrupt


def train(cfg: DictConfig, callbacks: Sequence[L.Callback] = (), command: str | None = None) -> dict:
    """Run one training job (``ngrpo train``) on a composed config; returns a summary dict.

    ``command``: what retrains this run (default: this command line). ``callbacks``: more for the Trainer::

        from ngrpo_lightning.commands.train import train
        from ngrpo_lightning.config import compose
        train(compose(["model=tiny", "trainer.max_steps=2"]), callbacks=[MyCallback()])
    """
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    quiet_libraries(verbose=bool(cfg.logger.get("verbose", False)))
    threads = prepare_process(cfg)  # checks, seed, threads: as a script's build_run (build/run.py)
    if rank_zero_only.rank == 0:
        print(header(cfg, threads), flush=True)
    # resume=last | path: the same run continues (weights, RNG, data position, MLflow run)
    ckpt_path = resolve_resume(cfg)
    meta = checkpoint_meta(ckpt_path) if ckpt_path else {}
    if ckpt_path:
        check_resume(cfg, meta)  # a checkpoint of another model or config: a clear error, nothing runs
    problems = build_problems(cfg.data, cfg.seed)  # data errors first: before minutes of model loading
    claim_output_dir(cfg, ckpt_path, meta)  # another run's checkpoints there: refused, or overwrite=true
    logger = build_logger(cfg, run_id=meta.get("mlflow_run_id"), monitor=True)  # so are tracking-store errors
    try:
        summary = _fit(cfg, logger, problems, ckpt_path, callbacks, command or retrain_command(command_line()), meta)
    except BaseException as err:
        if logger is not None:  # the run's status says what happened (a SIGKILL leaves it RUNNING)
            logger.close("KILLED" if isinstance(err, KeyboardInterrupt) else "failed")
        raise
    if logger is not None:
        logger.close("success")
    return summary


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the run; its text says where and what resumes it; ``status``: 128 + the signal."""

    def __init__(self, text: str, status: int):
        super().__init__(text)
        self.status = status


def interrupted(cfg: DictConfig, trainer: L.Trainer, signal: str, status: int) -> Interrupted:
    last = Path(cfg.output_dir) / "checkpoints" / "last.ckpt"
    if last.exists():
        try:
            where = f"step {load_checkpoint(last)['global_step']} ({last})"
        except ConfigError:
            where = str(last)
        resume = f"resume=last continues from {where}"
    elif trainer.global_step == 0:
        resume = "no step had finished, so no checkpoint was written"
    else:
        resume = "no checkpoint was written (trainer.enable_checkpointing=false)"
    return Interrupted(f"{signal} stopped the run at step {trainer.global_step}: {resume}", status)


def _fit(
    cfg: DictConfig,
    logger,
    problems,
    ckpt_path: str | None,
    callbacks: Sequence[L.Callback] = (),
    command: str = "",
    meta: dict | None = None,
) -> dict:
    """Validate, fit and validate again; the run's summary (``meta``: a resumed run's checkpoint's)."""
    module, datamodule = assemble(cfg, problems, backend_choices=(meta or {}).get("backend_choices"))
    if rank_zero_only.rank == 0:  # what the backend chose for this machine, and what it warns about
        notes = [module.backend.summary(), *module.backend.startup_notes()]
        print("\n".join(f"  backend:  {line}" for line in notes), flush=True)
    trainer = build_trainer(cfg, logger, callbacks=[*build_pass_at_k(cfg, problems[1]), *callbacks])
    module.run_meta = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "mlflow_run_id": getattr(logger, "run_id", None),
        "command": command,
    }
    if logger is not None and not ckpt_path:
        log_config(logger, cfg)
        components = {"explorer": module.explorer, "objective": module.objective}
        log_components(logger, components, flatten(OmegaConf.to_container(cfg, resolve=True)))
    if logger is not None and rank_zero_only.rank == 0 and module.backend.recorded_choices():
        logger.experiment.log_dict(logger.run_id, module.backend.recorded_choices(), "backend_choices.json")
    t0 = time.perf_counter()
    validate_first = cfg.validate_before_fit and datamodule.val_problems and not ckpt_path
    try:
        before = trainer.validate(module, datamodule=datamodule, verbose=False) if validate_first else None
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)  # as data only
        if any(cb.requested for cb in trainer.callbacks if isinstance(cb, StopOnInterrupt)):
            raise interrupted(cfg, trainer, "Ctrl-C", 130)  # stopped after a step, saved: no validation
        after = trainer.validate(module, datamodule=datamodule, verbose=False) if datamodule.val_problems else None
    except SIGTERMException:  # Lightning's, at the end of the step under way (a scheduler's stop, `timeout`)
        raise interrupted(cfg, trainer, "SIGTERM", 143) from None
    except SystemExit:
        if trainer.interrupted:  # Lightning turns Ctrl-C into exit status 1 after its teardown
            raise interrupted(cfg, trainer, "Ctrl-C", 130) from None
        raise
    finally:
        datamodule.close()
    if not trainer.is_global_zero:  # other ranks of a multi-process run: rank 0 reports
        return {"steps": trainer.global_step, "text": "", "run_id": None}
    summary = summarize_run(trainer, logger, before, after, time.perf_counter() - t0, getattr(module, "first_step", 0))
    if cfg.export.final:
        exported = export_final(cfg, module, trainer, logger, after)
        summary["text"] += f"\n  exported:   {exported} (a Hugging Face model; docs/checkpoints.md)"
    return summary


def export_final(cfg: DictConfig, module, trainer, logger, after) -> Path:
    """``export.final``: the trained policy as a Hugging Face model in ``export.dir`` (default
    ``<output_dir>/hf_model``), logged to the run's MLflow artifacts (``model/``)."""
    out = Path(cfg.export.dir or Path(cfg.output_dir) / "hf_model")
    again = is_own_export(out)  # a resumed run replaces its own export; anything else is refused
    if module.parallel is not None:  # sharded weights: the checkpoint written at the end of training holds them whole
        return export_checkpoint(str(cfg.output_dir), out, log_to_mlflow=logger is not None, overwrite=again)["out"]
    metrics = {k: float(v) for k, v in (after[0] if after else {}).items() if k.startswith("val/")}
    card = model_card(
        module.run_meta["config"], module.run_meta, trainer.global_step, metrics, adapters=module.adapters
    )
    written: list[str] = []
    save_hf_model(module.policy, module.tokenizer, out, card, overwrite=again, written=written)
    if logger is not None:
        log_exported(logger.experiment, logger.run_id, out, written)  # the files it wrote, never a user's
    return out


def retrain_command(command: str) -> str:
    """``command`` without ``resume=`` and ``overwrite=``: what trains the run from its start."""
    words = shlex.split(command)
    return shlex.join([w for w in words if not w.startswith(("resume=", "overwrite=", "+resume=", "+overwrite="))])


def command_line() -> str:
    """The command that started this process, as a user would type it again."""
    program = Path(sys.argv[0]).name
    return shlex.join(["ngrpo" if program in ("ngrpo", "cli.py", "launch.py") else sys.argv[0], *sys.argv[1:]])
