"""``best.ckpt``: the checkpoint at the best value of a validation or Pass@k metric (``checkpoint.best``)."""

from __future__ import annotations

import re

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from ngrpo_lightning.compat import lightning as lightning_compat
from ngrpo_lightning.config import ConfigError

__all__ = ["BestCheckpoint"]


class BestCheckpoint(ModelCheckpoint):
    """``best.ckpt``: ``ModelCheckpoint`` on a validation metric (``checkpoint.best``) that also counts the validation
    after the fit, which Lightning's does not see. The one before the fit checks that the run logs the metric (an
    unknown name is refused before any step). A Pass@k metric is scored at each evaluation of its callback
    (:attr:`scheduled`), its name checked against the callback's ``metric_names``."""

    _fit_ended = False
    _checked = False
    _known = True  # the run logs the monitored metric
    _seen = None  # the last value of a Pass@k metric considered

    @property
    def scheduled(self) -> bool:
        """Whether the metric is a Pass@k one (``val/<set>/pass@16``), logged on its callback's schedule."""
        return bool(re.search(r"@\d+$", str(self.monitor)))

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.scheduled:  # known now, from the callback's config: refused before any step
            self._check_scheduled(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._fit_ended = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        self._score_new_evaluation(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._score_new_evaluation(trainer)  # a Pass@k evaluation after a fit that stopped early
        self._fit_ended = True

    def _score_new_evaluation(self, trainer: L.Trainer) -> None:
        """Score a Pass@k metric whenever its callback has evaluated (a new value), not at validations."""
        value = trainer.callback_metrics.get(self.monitor)
        if self.scheduled and value is not None and value is not self._seen:
            self._seen = value
            lightning_compat.save_topk(self, trainer, lightning_compat.monitor_candidates(self, trainer))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.scheduled:
            return
        if not self._checked and not trainer.sanity_checking:
            self._checked = True
            self._known = self._check_monitor(trainer, trainer.state.fn == TrainerFn.VALIDATING and not self._fit_ended)
        if not self._known:
            return
        super().on_validation_end(trainer, pl_module)  # inside the fit: Lightning's own rule
        if self._fit_ended and trainer.state.fn == TrainerFn.VALIDATING:
            lightning_compat.save_topk(self, trainer, lightning_compat.monitor_candidates(self, trainer))

    def _check_scheduled(self, trainer: L.Trainer) -> None:
        """A Pass@k metric must be one that a Pass@k callback of the run logs."""
        names = [name for cb in trainer.callbacks if hasattr(cb, "metric_names") for name in cb.metric_names()]
        if self.monitor in names:
            return
        as_mlflow = lambda name: str(name).replace("@", "_at_")  # noqa: E731 - as the user reads it in MLflow
        asked = f"checkpoint.best={as_mlflow(self.monitor)!r}"
        if not names:
            raise ConfigError(
                f"{asked} is a Pass@k metric, but this run evaluates no Pass@k (pass_at_k.n > 0 and a validation set)"
            )
        raise ConfigError(f"{asked} is not a Pass@k metric of this run: it logs {[as_mlflow(n) for n in names]}")

    def _check_monitor(self, trainer: L.Trainer, before_fit: bool) -> bool:
        """Whether the run logs the metric; before the fit, a config error where it does not."""
        if self.monitor in trainer.callback_metrics:
            return True
        logged = sorted(key for key in trainer.callback_metrics if key.startswith("val/"))
        message = f"checkpoint.best={self.monitor!r} is not a validation metric of this run: it logs {logged}"
        if before_fit:  # nothing trained yet: refuse, as a config error
            raise ConfigError(message)
        rank_zero_warn(f"{message}; the run goes on without best.ckpt")  # steps trained: not thrown away
        return False
