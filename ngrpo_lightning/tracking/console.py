"""What a run prints: a header, one progress bar per phase, warnings that need the user, a summary.

Libraries are quietened at their source, by their loggers' levels and their own switches (never by
redirecting output); ``logger.verbose=true`` (``ngrpo train -v``) leaves them as they are."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
import warnings
from pathlib import Path

import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from omegaconf import DictConfig

__all__ = ["StepProgressBar", "header", "quiet_libraries", "show_notes", "show_own_warnings"]

# logger -> the level below which its records are not shown
QUIET = {
    "mlflow": logging.WARNING,  # store creation, system-metrics monitor start and stop
    "lightning.pytorch.utilities.rank_zero": logging.WARNING,  # GPU/TPU available, tips, "Trainer.fit stopped"
    "lightning.fabric.utilities.rank_zero": logging.WARNING,
    "lightning.pytorch.loggers.mlflow": logging.ERROR,  # "Experiment with name ... not found. Creating it."
    "lightning.pytorch.accelerators.cuda": logging.WARNING,
    "alembic": logging.WARNING,  # MLflow's database migrations
}


def quiet_libraries(verbose: bool = False) -> None:
    """Silence the libraries' routine output unless ``verbose``; show this package's notes (:func:`show_notes`)."""
    show_notes()
    show_own_warnings()
    if verbose:
        return
    for name, level in QUIET.items():
        logging.getLogger(name).setLevel(level)
    # MLflow sets its loggers' levels when imported, later: its own switch keeps them quiet then
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights: 100%": instant for models on disk


class _RankZero(logging.Filter):
    """Only the first process's records: every rank decodes alike and would say it as many times."""

    def filter(self, record: logging.LogRecord) -> bool:
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        return getattr(rank_zero_only, "rank", 0) == 0


PACKAGE_DIRS = tuple(
    str(Path(p).resolve()) for p in (Path(__file__).parents[1], Path(__file__).parents[2] / "callbacks")
)


def show_own_warnings() -> None:
    """This package's warnings as ``ngrpo: warning: <message>``, without the code's path and line; others unchanged."""
    previous = warnings.formatwarning
    if getattr(previous, "ngrpo", False):
        return

    def formatwarning(message, category, filename, lineno, line=None):
        if str(Path(filename).resolve()).startswith(PACKAGE_DIRS):
            return f"ngrpo: warning: {message}\n"
        return previous(message, category, filename, lineno, line)

    formatwarning.ngrpo = True
    warnings.formatwarning = formatwarning


def show_notes() -> None:
    """This package's INFO lines (what a run decided as it went) on stderr as ``ngrpo: <line>``; where
    a root handler already shows them (a sweep's), only the level is set."""
    package = logging.getLogger("ngrpo_lightning")
    package.setLevel(logging.INFO)
    if logging.getLogger().handlers or any(isinstance(h, logging.StreamHandler) for h in package.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("ngrpo: %(message)s"))
    handler.addFilter(_RankZero())
    package.addHandler(handler)  # (Python's last-resort handler prints only where no handler is found)


def c_allocator() -> str:
    """``mimalloc`` when it was preloaded (docs/performance.md, "The allocator"), else ``system``."""
    return "mimalloc" if hasattr(ctypes.CDLL(None), "mi_version") else "system"


def header(cfg: DictConfig, threads=None) -> str:
    """One block saying what this run is (``threads``: :class:`~ngrpo_lightning.backends.threads.ProcessThreads`)."""
    model, data, r = cfg.model, cfg.data, cfg.rollout
    explorer = cfg.explorer.get("name") or cfg.explorer.get("_target_")
    objective = cfg.objective.get("name") or cfg.objective.get("_target_")
    task = data.get("name") or data.source
    if data.get("tasks"):
        names = [t.get("name", "?") if hasattr(t, "get") else str(t) for t in data.tasks]
        task += f" ({', '.join(names)})"
    trainer = cfg.trainer
    devices = trainer.get("devices", 1)
    where = f"{trainer.get('accelerator', 'auto')} x {devices}" if devices != 1 else str(trainer.get("accelerator"))
    if str(trainer.get("accelerator")) == "cpu":
        counted = threads.describe() if threads is not None else f"{torch.get_num_threads()} threads"
        where += f", {counted}, {c_allocator()} allocator"
    staleness = (cfg.get("train") or {}).get("max_staleness", 0)
    if staleness:  # rollouts come from older weights: the user should see it at once
        where += f"; rollouts {staleness} step(s) ahead on a worker"
    tracking = (
        f"MLflow {cfg.logger.tracking_uri} (experiment {cfg.experiment_name!r})"
        if cfg.logger.get("name") == "mlflow"
        else "off (logger=none)"
    )
    lines = [
        f"ngrpo train: {explorer} x {objective}, {trainer.max_steps} step{'' if trainer.max_steps == 1 else 's'}",
        f"  model:    {model.name_or_path} ({model.dtype}{_lora(model)})",
        f"  task:     {task}; {data.prompts_per_step} prompts x {r.group_size} samples per step, "
        f"at most {r.max_new_tokens} new tokens",
        f"  device:   {where}",
        f"  tracking: {tracking}",
        f"  output:   {cfg.output_dir}",
    ]
    return "\n".join(lines)


def _lora(model) -> str:
    """``, LoRA rank 16 (only the adapters train)`` for a LoRA run's header, else nothing."""
    lora = model.get("lora") or {}
    return f", LoRA rank {lora.get('rank')}: only the adapters train" if lora.get("enabled") is True else ""


class StepProgressBar(TQDMProgressBar):
    """One bar per phase: "step 7/15" (reward, accuracy, s/step, tok/s) and "validate 3/4"; no epochs."""

    def init_train_tqdm(self) -> Tqdm:
        return self._bar("step {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}", 0, leave=True)

    def init_validation_tqdm(self) -> Tqdm:
        during_fit = self.trainer.state.fn != "validate"
        return self._bar("validate {n_fmt}/{total_fmt} [{elapsed}<{remaining}]", int(during_fit), leave=not during_fit)

    def _bar(self, bar_format: str, row: int, leave: bool) -> Tqdm:
        position = 2 * self.process_position + row
        return Tqdm(
            position=position,
            disable=self.is_disabled,
            leave=leave,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=bar_format,
        )

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._count_steps(trainer)  # a run resumed mid-epoch gets no on_train_epoch_start

    def on_train_epoch_start(self, trainer, *_) -> None:
        self._count_steps(trainer)

    def _count_steps(self, trainer) -> None:
        """The bar counts rollout batches (steps) out of ``max_steps``, from where the run is."""
        plan = getattr(trainer.lightning_module, "plan", None)  # several optimizer steps per rollout batch
        self._updates = plan.updates_per_step if plan is not None else 1
        total = math.ceil(trainer.max_steps / self._updates) if trainer.max_steps > 0 else None
        self.train_progress_bar.reset(total=total)
        self.train_progress_bar.n = trainer.global_step // self._updates  # a resumed run starts where it was

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        bar = self.train_progress_bar
        bar.n = trainer.global_step // self._updates  # steps, across passes over the data
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        bar.refresh()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """End the bars' lines: the error the command prints next starts on a line of its own."""
        for name in ("val_progress_bar", "train_progress_bar"):
            try:
                bar = getattr(self, name)
            except TypeError:  # Lightning's property raises for a bar not made yet
                continue
            if not bar.disable:
                bar.close()

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        formats = {"reward": "{:.3f}", "acc": "{:.3f}", "s/step": "{:.1f}", "tok/s": "{:.0f}"}
        return {k: formats.get(k, "{}").format(float(v)) if k in formats else v for k, v in metrics.items()}
