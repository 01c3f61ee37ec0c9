"""What the training module reports (step metrics to the logger and progress bar, validation's accuracy and reward):
:class:`StepReports`, a mixin of :class:`~ngrpo_lightning.training.module.RLModule`."""

from __future__ import annotations

import math
import time

import torch

from ngrpo_lightning.metrics.exploration import exploration_metrics
from ngrpo_lightning.metrics.training import host_floats, rollout_step_metrics
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.training.updates import StepRollouts


class StepReports:
    """A step's metrics and validation's, as the module logs them (see the module docstring)."""

    def _attached_trainer(self):
        """The trainer the module is attached to, or ``None``."""
        try:
            return self.trainer
        except RuntimeError:
            return None

    def log_step(
        self, batch: RolloutBatch, scored, rewards: torch.Tensor, step: StepRollouts, metrics: dict, phases: dict
    ) -> None:
        """Log the step: rollout statistics of the fresh batch, loss metrics of the updates, and ``phases``: seconds
        of the step's reward, log-prob (old, reference) and update phases."""
        log = {f"train/{k}": v for k, v in metrics.items()}
        log.update(rollout_step_metrics(batch, rewards, step))
        log.update(step.stats)  # replay/*, dynamic/*
        log.update(scored.metrics())  # reward/* status fractions
        log.update(exploration_metrics(batch, scored.answers))  # explore/*, on the answers the reward extracted
        log.update(batch.stats)  # rollout/* timings and throughput
        log.update(phases)  # time/*_s
        now = time.perf_counter()
        log["time/step_s"] = now - (self._last_step_end or self._fit_start or now)
        self._last_step_end = now
        # several processes: each rank's statistics averaged over ranks (sync_dist; *_max/*_min reduced as such)
        trainer = self._attached_trainer()
        sync = trainer is not None and trainer.world_size > 1
        device = self.device if sync else "cpu"
        log = host_floats({**log, "reward": rewards.mean()})  # one read of the device for all of them
        reward = log.pop("reward")
        for key, value in log.items():
            op = "max" if key.endswith("_max") else "min" if key.endswith("_min") else "mean"
            self.log(
                key,
                torch.as_tensor(value, device=device),
                on_step=True,
                batch_size=len(batch),
                sync_dist=sync,
                reduce_fx=op,
            )
        self.log_dict(
            {
                "reward": reward,
                "acc": log["train/accuracy"],
                "s/step": log["time/step_s"],
                "tok/s": float(batch.stats.get("rollout/tokens_per_s", math.nan)),
            },
            prog_bar=True,
            logger=False,
            batch_size=len(batch),
            sync_dist=sync,
        )

    # ------------------------------------------------------------- validation
    def validation_step(self, batch: RolloutBatch, batch_idx: int):
        scored = self.score(batch)
        self.val_accuracy.update(scored.correct.float())
        self.val_reward.update(scored.scores)
        return {"rewards": scored.scores, "status": scored.status}

    def on_validation_epoch_end(self):
        trainer = self._attached_trainer()
        sync = trainer is not None and trainer.world_size > 1  # compute() already reduced over ranks
        self.log("val/accuracy", self.val_accuracy.compute(), prog_bar=True, sync_dist=sync)
        self.log("val/reward", self.val_reward.compute(), sync_dist=sync)
        # normal tensors: reset() in inference mode (trainer.validate) would leave them unwritable during a later fit
        with torch.inference_mode(False):
            self.val_accuracy.reset()
            self.val_reward.reset()
