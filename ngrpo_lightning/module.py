"""The LightningModule: policy optimization on rollouts of the current policy.

A run composes an :class:`~ngrpo_lightning.explorers.Explorer` (how rollouts explore;
used by the rollout DataModule) with a :class:`~ngrpo_lightning.objectives.PolicyObjective`
(how rollouts become a loss). Each training step receives a :class:`RolloutBatch` of the
current policy and does::

    rewards -> [replay: mix in stored trajectories] -> [dynamic sampling: drop groups with
    equal rewards, roll out more] -> group advantages -> old log-probs (policy, no grad)
    -> reference log-probs -> for each planned update: micro-batched loss -> backward
    -> clip -> optimizer step -> lr scheduler step

The updates come from the attached :class:`~ngrpo_lightning.updates.UpdatePlanner`
callback (``callbacks.ReplayBuffer``: ``ppo_epochs x num_mini_batches`` of them); without
one, a step is one update on the whole batch.

Optimization is manual because one batch of rollouts may serve several optimizer updates
and because rollouts must see the weights of the last update. Lightning counts
``trainer.global_step`` in optimizer steps under manual optimization: ``max_steps`` is a
number of optimizer updates, i.e. ``max_steps / (ppo_epochs * num_mini_batches)`` rollout
batches. Logged metrics are indexed by rollout batch.
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
from .checkpointing import config_mismatch, rng_states, set_rng_states
from .parallel import ParallelConfig, clip_grad_norm, shard_fsdp2
from .updates import StepRollouts, UpdatePlanner


@dataclass
class OptimConfig:
    """Optimizer and schedule (``optim.*`` in configs)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0  # in optimizer steps
    grad_clip: float = 1.0
    micro_batch_size: int = 0  # rollouts per forward/backward (0 = the whole mini-batch at once)


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
        dynamic_sampling: DAPO's dynamic sampling: drop groups whose rewards are all equal
            and refill the batch with more rollouts (from the DataModule's
            ``more_rollouts()``) up to its number of groups.
        max_extra_rollouts: at most this many extra prompt batches per step; if the batch
            is still short, the step trains on the groups it has.
        tis_cap: truncated importance sampling of the rollout/train mismatch (an engine's
            log-probs differ from the trainer's, e.g. vLLM in bf16): the policy gradient of
            every fresh token is weighted by ``min(exp(old_logp - rollout_logp), tis_cap)``.
            None = off. Needs an objective with ``token_advantages`` (GRPO).
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
        dynamic_sampling: bool = False,
        max_extra_rollouts: int = 4,
        parallel: ParallelConfig | dict | None = None,
        tis_cap: float | None = None,
    ):
        super().__init__()
        self.automatic_optimization = False
        self.policy, self.tokenizer = policy, tokenizer
        self.explorer, self.objective, self.reward = explorer, objective, reward
        self.eval_explorer = eval_explorer or TemperatureExplorer(temperature=0.0)
        self.optim = optim or OptimConfig()
        self.advantage, self.detach_mixture = advantage, detach_mixture
        if objective.needs_reference and reference is None:
            raise ValueError(f"objective.kl_coef={objective.kl_coef} > 0 needs a reference model, but none was given "
                             "(set objective.kl_coef=0 to train without one)")
        self.reference = reference if objective.needs_reference else None
        if self.reference is not None:
            self.reference.requires_grad_(False).eval()
        group_advantages(torch.zeros(2), 2, advantage)  # fail now on an unknown estimator name
        if isinstance(max_extra_rollouts, bool) or not isinstance(max_extra_rollouts, int) or max_extra_rollouts < 0:
            raise ValueError(f"train.max_extra_rollouts={max_extra_rollouts!r} must be an integer >= 0")
        self.dynamic_sampling, self.max_extra_rollouts = bool(dynamic_sampling), max_extra_rollouts
        if tis_cap is not None and not (isinstance(tis_cap, (int, float)) and tis_cap > 0):
            raise ValueError(f"train.tis_cap={tis_cap!r} must be a number > 0 (or null to disable)")
        if tis_cap is not None and not getattr(objective, "token_advantages", False):
            raise ValueError(f"train.tis_cap needs an objective that takes per-token advantages; "
                             f"{type(objective).__name__} does not (GRPO does)")
        self.tis_cap = tis_cap
        self.update_metrics: list[dict[str, float]] = []  # per-update metrics of the last step (for inspection)
        self._fit_start = self._last_step_end = None
        self.val_accuracy = MeanMetric()
        self.val_reward = MeanMetric()
        self.parallel = ParallelConfig(**parallel) if isinstance(parallel, dict) else parallel
        self.run_meta: dict = {}  # what identifies the run in checkpoints (set by the CLI: config, MLflow run id)
        self._forwards: dict[int, torch.nn.Module] = {}  # FSDP2 root wrappers (kept outside the module tree)
        self.policy_version = 0  # optimizer steps taken by this process: engines with their own weights sync on change

    # --------------------------------------------------------------- sharding
    def configure_model(self) -> None:
        """FSDP2 under ``ModelParallelStrategy``: ``fully_shard`` per decoder layer, then at
        the root (a wrapper around the model whose forward rebuilds the inputs), for the
        policy and the reference. bf16 parameters with fp32 gradient reduction, or fp32;
        optional activation checkpointing and CPU offload. A no-op without a device mesh."""
        if self.parallel is None or self._forwards:
            return
        try:
            mesh = self.device_mesh
        except RuntimeError:
            mesh = None
        if mesh is None:
            return
        self._forwards = shard_fsdp2([self.policy, self.reference], self.parallel, mesh["data_parallel"],
                                     checkpoint=self.policy)

    def _logprobs(self, model: torch.nn.Module, batch: RolloutBatch, temperature: float, **kwargs):
        forward = self._forwards.get(id(model))
        if forward is not None:
            return forward(batch, temperature, **kwargs)
        return response_logprobs(model, batch, temperature, **kwargs)

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
    def on_fit_start(self) -> None:
        if self.dynamic_sampling and self.trainer.world_size > 1:
            # ranks would roll out different numbers of extra batches, and rollouts under FSDP are collectives
            raise ValueError("train.dynamic_sampling=true is not supported with several processes yet: "
                             "use one process or train.dynamic_sampling=false")

    def on_train_start(self) -> None:
        self._fit_start, self._last_step_end = time.perf_counter(), None

    def score(self, batch: RolloutBatch):
        """Rewards of a rollout batch (a :class:`~ngrpo_lightning.rewards.RewardResult`)."""
        return self.reward(batch.response_text, batch.answers)

    @property
    def update_planner(self) -> UpdatePlanner | None:
        """The attached callback that plans this module's updates (``callbacks.ReplayBuffer``), if any."""
        trainer = self._trainer
        planners = [cb for cb in (trainer.callbacks if trainer is not None else []) if isinstance(cb, UpdatePlanner)]
        if len(planners) > 1:
            raise ValueError(f"at most one update planner callback may be attached, got {[type(p).__name__ for p in planners]}")
        return planners[0] if planners else None

    def training_step(self, batch: RolloutBatch, batch_idx: int):
        scored = self.score(batch)
        rewards = scored.scores.to(self.device)
        planner = self.update_planner
        step = self.collect(batch, rewards, planner)
        self.prepare(step, reuse_forward=planner is None)
        updates = planner.plan_updates(step) if planner is not None else [step]
        metrics = self.optimize(updates)
        self.log_step(batch, scored, rewards, step, metrics)
        return {"rewards": rewards.detach().cpu(), "status": scored.status, "rollouts": step}

    def collect(self, batch: RolloutBatch, rewards: torch.Tensor, planner: UpdatePlanner | None = None) -> StepRollouts:
        """The rollouts this step trains on: the batch, with the planner's stored
        trajectories mixed in and, under dynamic sampling, its zero-variance groups
        replaced by informative groups of extra rollouts."""
        pad_id = self.tokenizer.pad_token_id or 0
        mix = planner.mix_in if planner is not None else (lambda s: s)
        step = mix(StepRollouts.fresh(batch, rewards, pad_id))
        if not self.dynamic_sampling:
            return step
        target, kept, dropped, extra, piece = step.num_groups, [], 0, 0, step
        while True:
            informative = ~zero_variance_groups(piece.rewards, piece.group_size)
            dropped += int((~informative).sum())
            if informative.any():
                kept.append(piece.select_groups(informative.nonzero().squeeze(-1).cpu()))
            if sum(k.num_groups for k in kept) >= target or extra >= self.max_extra_rollouts:
                break
            more = self._more_rollouts()
            extra += 1
            piece = mix(StepRollouts.fresh(more, self.score(more).scores.to(self.device), pad_id))
        if kept:  # surplus informative groups (beyond the batch's size) are discarded
            joined = StepRollouts.concat(kept)
            filled = joined.select_groups(torch.arange(min(target, joined.num_groups)))
        else:  # nothing informative within the bound: the original batch (zero advantages)
            filled = step
        filled.stats = {**step.stats, "dynamic/dropped_groups": dropped, "dynamic/extra_rollouts": extra,
                        "dynamic/kept_groups": filled.num_groups if kept else 0}
        return filled

    def _more_rollouts(self) -> RolloutBatch:
        datamodule = getattr(self._trainer, "datamodule", None)
        if not hasattr(datamodule, "more_rollouts"):
            raise RuntimeError("train.dynamic_sampling=true needs a datamodule with more_rollouts() "
                               "(ngrpo_lightning.rollout.RolloutDataModule), passed as trainer.fit(..., datamodule=...)")
        return datamodule.more_rollouts()

    @torch.no_grad()
    def prepare(self, step: StepRollouts, reuse_forward: bool = False) -> None:
        """Set the step's advantages, old (proximal) log-probs and reference log-probs.

        With ``reuse_forward`` (one on-policy update per step: no planner) the old log-probs
        are the detached log-probs of the update's own forward: the same weights compute the
        same numbers, so a separate no-grad pass of the policy would be pure cost."""
        step.advantages = group_advantages(step.rewards, step.group_size, self.advantage)
        step.old_logp = None if reuse_forward else self._logprobs_no_grad(self.policy, step.batch)
        step.ref_logp = self._logprobs_no_grad(self.reference, step.batch) if self.reference is not None else None

    def _logprobs_no_grad(self, model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
        """Response log-probs [N, L] of ``model``, computed ``optim.micro_batch_size`` rows at a time."""
        temperature = self.explorer.temperature or 1.0
        chunks = [batch.select(rows) if len(rows) < len(batch) else batch for rows, _ in self._micro_batches(batch)]
        return torch.cat([self._logprobs(model, chunk, temperature)[0] for chunk in chunks])

    def optimize(self, updates: list[StepRollouts]) -> dict[str, torch.Tensor]:
        """One optimizer (and lr scheduler) step per update; returns the metrics of all
        updates combined (means; ``*_min``/``*_max`` over updates)."""
        opt, sched = self.optimizers(), self.lr_schedulers()
        temperature = self.explorer.temperature or 1.0
        self.update_metrics = []
        for update in updates:
            opt.zero_grad(set_to_none=True)
            parts, weights, old_parts = [], [], []
            for rows, weight in self._micro_batches(update.batch):
                mb = update.select(rows) if len(rows) < len(update) else update
                logp, entropy = self._logprobs(self.policy, mb.batch, temperature, with_entropy=True,
                                               detach_mixture=self.detach_mixture)
                if mb.old_logp is None:  # single on-policy update: see prepare(reuse_forward=True)
                    mb.old_logp = logp.detach()
                    old_parts.append(mb.old_logp)
                advantages, tis = self._tis_advantages(mb)
                loss, m = self.objective(logp, mb.old_logp, mb.ref_logp, advantages, mb.batch.response_mask)
                self.manual_backward(loss * weight)
                parts.append({**m, **tis, "loss": loss, "entropy": masked_mean(entropy, mb.batch.response_mask)})
                weights.append(weight)
            if old_parts:
                update.old_logp = torch.cat(old_parts)
            metrics = combine_metrics(parts, weights)
            metrics["grad_norm"] = clip_grad_norm(self.policy.parameters(), self.optim.grad_clip or math.inf)
            opt.step()
            sched.step()
            self.policy_version += 1
            self.update_metrics.append({k: float(v) for k, v in metrics.items()})
        out = combine_metrics(self.update_metrics, [1.0 / len(updates)] * len(updates))
        out["updates"] = len(updates)
        return out

    def _tis_advantages(self, mb: StepRollouts) -> tuple[torch.Tensor, dict]:
        """Advantages, per token with the truncated importance weights of the fresh rows
        when ``tis_cap`` is set (replayed rows carry their own correction: weight 1)."""
        if self.tis_cap is None:
            return mb.advantages, {}
        fresh = (~mb.replayed)[:, None] & mb.batch.response_mask.bool()
        ratio = torch.exp((mb.old_logp - mb.batch.rollout_logprobs).clamp(max=20.0))
        weights = torch.where(fresh, ratio.clamp(max=self.tis_cap), torch.ones_like(ratio))
        stats = {"tis_weight_mean": masked_mean(weights, fresh), "tis_clipped_frac": masked_mean((ratio > self.tis_cap).float(), fresh)}
        return mb.advantages[:, None] * weights, stats

    def _micro_batches(self, batch: RolloutBatch):
        """Yield (rows, weight): the loss of each micro-batch is scaled so that the sum of
        the micro-batch gradients equals the gradient of the whole batch's loss."""
        n, size = len(batch), self.optim.micro_batch_size or len(batch)
        tokens = batch.response_mask.sum().clamp(min=1)
        token_level = self.objective.loss_agg == "token-mean"
        for start in range(0, n, size):
            rows = torch.arange(start, min(start + size, n))
            share = batch.response_mask[rows].sum() / tokens if token_level else torch.tensor(len(rows) / n)
            yield rows, share.item()

    def log_step(self, batch: RolloutBatch, scored, rewards: torch.Tensor, step: StepRollouts, metrics: dict) -> None:
        """Log the step: rollout statistics of the fresh batch, loss metrics of the updates."""
        lengths = batch.response_lengths.float()
        fresh = (~step.replayed)[:, None] * step.batch.response_mask
        mismatch = (step.batch.rollout_logprobs - step.old_logp).abs()
        log = {f"train/{k}": v for k, v in metrics.items()}
        advantages = step.advantages
        log.update({
            "train/reward": rewards.mean(),
            "train/accuracy": (rewards > 0.5).float().mean(),  # rewards are 0/1: binary accuracy
            "train/advantage_mean": advantages.mean(),
            "train/advantage_std": advantages.std() if len(advantages) > 1 else advantages.new_tensor(0.0),
            "train/zero_variance_groups": zero_variance_groups(rewards, batch.group_size).float().mean(),
            "train/response_length_mean": lengths.mean(),
            "train/response_length_max": lengths.max(),
            "train/truncated_frac": batch.truncated.float().mean() if batch.truncated is not None else 0.0,
            # the rollout/train mismatch: the engine's log-probs of the sampled tokens vs the trainer's
            "train/rollout_logprob_diff_mean": masked_mean(mismatch, fresh),
            "train/rollout_logprob_diff_max": mismatch[fresh.bool()].max() if fresh.any() else 0.0,
        })
        log.update(step.stats)  # replay/*, dynamic/*
        log.update(scored.metrics())  # reward/* status fractions
        log.update(exploration_metrics(batch, scored.answers))  # explore/*, on the answers the reward extracted
        log.update(batch.stats)  # rollout/* timings and throughput
        now = time.perf_counter()
        log["time/step_s"] = now - (self._last_step_end or self._fit_start or now)
        self._last_step_end = now
        # Under several processes every rank logs its own rollouts' statistics: they are
        # averaged over ranks (sync_dist; ``*_max``/``*_min`` reduced as such). The loss metrics
        # are those of each rank's share of the global batch.
        sync = self._trainer is not None and self._trainer.world_size > 1
        device = self.device if sync else "cpu"
        for key, value in log.items():
            op = "max" if key.endswith("_max") else "min" if key.endswith("_min") else "mean"
            self.log(key, torch.as_tensor(float(value), device=device), on_step=True, batch_size=len(batch),
                     sync_dist=sync, reduce_fx=op)
        self.log_dict({"reward": float(rewards.mean()), "acc": float(log["train/accuracy"])}, prog_bar=True, logger=False,
                      batch_size=len(batch), sync_dist=sync)

    # ---------------------------------------------------------- checkpoints
    # Lightning saves the weights, optimizer, scheduler, loop progress (step), callbacks
    # (ReplayBuffer) and the datamodule (data position, engine RNG); the module adds the
    # explorer's state, the process RNG states and what identifies the run.
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["explorer"] = self.explorer.state_dict()  # counters and schedules (e.g. index refresh)
        checkpoint["rng"] = rng_states()
        checkpoint["ngrpo"] = dict(self.run_meta)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("ngrpo") or {}
        if saved.get("config") is not None and self.run_meta.get("config") is not None:
            problem = config_mismatch(saved["config"], self.run_meta["config"])
            if problem:
                raise ValueError(f"cannot resume from this checkpoint: {problem}")
        self.explorer.load_state_dict(checkpoint.get("explorer", {}))
        if "rng" in checkpoint:
            set_rng_states(checkpoint["rng"])

    # ------------------------------------------------------------- validation
    def validation_step(self, batch: RolloutBatch, batch_idx: int):
        scored = self.score(batch)
        self.val_accuracy.update((scored.scores > 0.5).float())
        self.val_reward.update(scored.scores)
        return {"rewards": scored.scores, "status": scored.status}

    def on_validation_epoch_end(self):
        sync = self._trainer is not None and self._trainer.world_size > 1  # compute() already reduced over ranks
        self.log("val/accuracy", self.val_accuracy.compute(), prog_bar=True, sync_dist=sync)
        self.log("val/reward", self.val_reward.compute(), sync_dist=sync)
        self.val_accuracy.reset()
        self.val_reward.reset()


def combine_metrics(parts: list[dict], weights: list[float]) -> dict[str, torch.Tensor]:
    """Weighted sums of metric dicts, except ``*_min`` (minimum) and ``*_max`` (maximum)."""
    out: dict[str, torch.Tensor] = {}
    for part, w in zip(parts, weights):
        for k, v in part.items():
            v = torch.as_tensor(v).detach().float()
            if k.endswith("_min"):
                out[k] = torch.minimum(out[k], v) if k in out else v
            elif k.endswith("_max"):
                out[k] = torch.maximum(out[k], v) if k in out else v
            else:
                out[k] = out.get(k, 0.0) + v * w
    return out
