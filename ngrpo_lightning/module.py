"""The LightningModule: one optimizer step of policy optimization per rollout batch.

A run composes an :class:`~ngrpo_lightning.explorers.Explorer` (how rollouts explore;
used by the rollout DataModule) with a :class:`~ngrpo_lightning.objectives.PolicyObjective`
(how rollouts become a loss). Each training step receives a :class:`RolloutBatch` of the
current policy and does::

    rewards -> group advantages -> old log-probs (policy, no grad) -> reference log-probs
            -> loss (objective) -> backward -> clip -> optimizer step

Optimization is manual because one batch of rollouts may serve several optimizer updates
(mini-batches, PPO epochs), and because rollouts must see the weights of the last update.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import lightning as L
import torch
from torchmetrics import MeanMetric

from .explorers import Explorer, TemperatureExplorer
from .forward import response_logprobs
from .metrics.exploration import exploration_metrics
from .objectives import PolicyObjective, group_advantages, masked_mean, zero_variance_groups
from .rewards import MathReward
from .rollout.batch import RolloutBatch


@dataclass
class OptimConfig:
    """Optimizer and schedule (``optim.*`` in configs)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    grad_clip: float = 1.0
    micro_batch_size: int = 0  # rollouts per forward/backward (0 = the whole batch at once)


class RLModule(L.LightningModule):
    """Policy optimization of a causal LM with a pluggable explorer and objective.

    Args:
        policy: the causal LM being trained (a transformers ``PreTrainedModel``).
        tokenizer: its tokenizer.
        explorer: how training rollouts explore (the DataModule asks the module for it).
        objective: the policy loss.
        reward: maps (responses, gold answers) to scores and statuses.
        reference: frozen reference model for the KL term; required iff ``objective.kl_coef > 0``.
        optim: optimizer settings.
        advantage: group advantage estimator (``grpo``, ``dr_grpo``, ``batch_std``).
        eval_explorer: how validation rollouts sample (plain sampling; never mixing).
        detach_mixture: stop gradients into the embedding matrix through mixed inputs.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer,
        explorer: Explorer,
        objective: PolicyObjective,
        reward: MathReward,
        reference: torch.nn.Module | None = None,
        optim: OptimConfig | None = None,
        advantage: str = "grpo",
        eval_explorer: Explorer | None = None,
        detach_mixture: bool = False,
    ):
        super().__init__()
        self.automatic_optimization = False
        self.policy, self.tokenizer = policy, tokenizer
        self.explorer, self.objective, self.reward = explorer, objective, reward
        self.eval_explorer = eval_explorer or TemperatureExplorer(temperature=0.0)
        self.optim = optim or OptimConfig()
        self.advantage, self.detach_mixture = advantage, detach_mixture
        if objective.needs_reference and reference is None:
            raise ValueError("objective.kl_coef > 0 needs a reference model, but none was given")
        self.reference = reference if objective.needs_reference else None
        if self.reference is not None:
            self.reference.requires_grad_(False).eval()
        group_advantages(torch.zeros(2), 2, advantage)  # fail now on an unknown estimator name
        self._fit_start = self._last_step_end = None
        self.val_accuracy = MeanMetric()
        self.val_reward = MeanMetric()

    @classmethod
    def reference_from(cls, policy: torch.nn.Module) -> torch.nn.Module:
        """A frozen copy of the policy's initial weights, to serve as the KL reference."""
        return copy.deepcopy(policy).requires_grad_(False).eval()

    # ------------------------------------------------------------------ optim
    def configure_optimizers(self):
        o = self.optim
        opt = torch.optim.AdamW(self.policy.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        warmup = max(int(o.warmup_steps), 0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ------------------------------------------------------------------ train
    def on_train_start(self) -> None:
        self._fit_start, self._last_step_end = time.perf_counter(), None

    def score(self, batch: RolloutBatch):
        """Rewards of a rollout batch (a :class:`~ngrpo_lightning.rewards.RewardResult`)."""
        return self.reward(batch.response_text, batch.answers)

    def training_step(self, batch: RolloutBatch, batch_idx: int):
        scored = self.score(batch)
        rewards = scored.scores.to(self.device)
        advantages = group_advantages(rewards, batch.group_size, self.advantage)
        temperature = self.explorer.temperature or 1.0
        with torch.no_grad():
            old_logp, _ = response_logprobs(self.policy, batch, temperature)
            ref_logp = response_logprobs(self.reference, batch, temperature)[0] if self.reference is not None else None

        opt = self.optimizers()
        sched = self.lr_schedulers()
        opt.zero_grad(set_to_none=True)
        metrics, entropies = {}, []
        for rows, weight in self._micro_batches(batch):
            mb = batch.select(rows) if len(rows) < len(batch) else batch
            logp, entropy = response_logprobs(self.policy, mb, temperature, with_entropy=True, detach_mixture=self.detach_mixture)
            loss, m = self.objective(logp, old_logp[rows], None if ref_logp is None else ref_logp[rows], advantages[rows], mb.response_mask)
            self.manual_backward(loss * weight)
            entropies.append(masked_mean(entropy, mb.response_mask) * weight)
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v.detach() * weight
            metrics["loss"] = metrics.get("loss", 0.0) + loss.detach() * weight
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.optim.grad_clip or math.inf)
        opt.step()
        sched.step()

        lengths = batch.response_lengths.float()
        log = {f"train/{k}": v for k, v in metrics.items()}
        log.update({
            "train/reward": rewards.mean(),
            "train/accuracy": (rewards > 0.5).float().mean(),  # rewards are 0/1: binary accuracy
            "train/entropy": sum(entropies),
            "train/grad_norm": grad_norm,
            "train/advantage_mean": advantages.mean(),
            "train/advantage_std": advantages.std() if len(advantages) > 1 else advantages.new_tensor(0.0),
            "train/zero_variance_groups": zero_variance_groups(rewards, batch.group_size).float().mean(),
            "train/response_length_mean": lengths.mean(),
            "train/response_length_max": lengths.max(),
            "train/truncated_frac": batch.truncated.float().mean() if batch.truncated is not None else 0.0,
            "train/rollout_logprob_diff_mean": masked_mean((batch.rollout_logprobs - old_logp).abs(), batch.response_mask),
        })
        log.update(scored.metrics())  # reward/* status fractions
        log.update(exploration_metrics(batch))  # explore/*
        log.update(batch.stats)  # rollout/* timings and throughput
        now = time.perf_counter()
        log["time/step_s"] = now - (self._last_step_end or self._fit_start)
        self._last_step_end = now
        self.log_dict({k: float(v) for k, v in log.items()}, on_step=True, batch_size=len(batch))
        self.log_dict({"reward": float(rewards.mean()), "acc": float(log["train/accuracy"])}, prog_bar=True, logger=False, batch_size=len(batch))
        return {"rewards": rewards.detach().cpu(), "status": scored.status}

    def _micro_batches(self, batch: RolloutBatch):
        """Yield (rows, weight): the loss of each micro-batch is scaled so that the sum of
        the micro-batch gradients equals the gradient of the whole batch's loss."""
        n, size = len(batch), self.optim.micro_batch_size or len(batch)
        tokens = batch.response_mask.sum().clamp(min=1)
        token_level = getattr(self.objective, "loss_agg", "seq-mean") == "token-mean"
        for start in range(0, n, size):
            rows = torch.arange(start, min(start + size, n))
            share = batch.response_mask[rows].sum() / tokens if token_level else torch.tensor(len(rows) / n)
            yield rows, share.item()

    # ------------------------------------------------------------- validation
    def validation_step(self, batch: RolloutBatch, batch_idx: int):
        scored = self.score(batch)
        self.val_accuracy.update((scored.scores > 0.5).float())
        self.val_reward.update(scored.scores)
        return {"rewards": scored.scores, "status": scored.status}

    def on_validation_epoch_end(self):
        self.log("val/accuracy", self.val_accuracy.compute(), prog_bar=True)
        self.log("val/reward", self.val_reward.compute())
        self.val_accuracy.reset()
        self.val_reward.reset()
