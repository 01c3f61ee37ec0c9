"""The LightningModule: policy optimization on rollouts of the current policy.

A run composes an :class:`~ngrpo_lightning.explorers.Explorer` (how rollouts explore) with a
:class:`~ngrpo_lightning.objectives.PolicyObjective` (how rollouts become a loss). A training step::

    rewards -> [replay: mix in stored trajectories] -> [dynamic sampling: drop groups with
    equal rewards, roll out more] -> group advantages -> old log-probs (policy, no grad)
    -> reference log-probs -> for each planned update: micro-batched loss -> backward
    -> clip -> optimizer step -> lr scheduler step

Updates are planned by :class:`~ngrpo_lightning.training.planning.UpdatePlan`, dynamic sampling by
:class:`~ngrpo_lightning.training.planning.DynamicSampling`; ``step_hooks``
(:class:`~ngrpo_lightning.training.updates.StepHook`) take part in every step. Optimization is manual: one rollout
batch may serve several optimizer updates, and rollouts must see the last update's weights. ``trainer.global_step``
counts optimizer steps, so ``max_steps`` is ``max_steps / (ppo_epochs * num_mini_batches)`` rollout batches. Logged
metrics are indexed by rollout batch (:mod:`~ngrpo_lightning.training.reports`).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import MeanMetric

from ngrpo_lightning.backends import Backend, backend_for, file_weights
from ngrpo_lightning.backends.recompute import recomputes, recomputing
from ngrpo_lightning.explorers import Explorer, TemperatureExplorer
from ngrpo_lightning.metrics.training import combine_metrics, host_floats
from ngrpo_lightning.models import lora
from ngrpo_lightning.objectives import (
    PolicyObjective,
    group_advantages,
    masked_mean,
    resolve_advantage,
    rollout_importance_weights,
)
from ngrpo_lightning.phases import phase
from ngrpo_lightning.rewards import MathReward, score_responses
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.rollout.context import PolicyVersion, RunContext
from ngrpo_lightning.training.checkpoint_hooks import CheckpointHooks, reference_not_required
from ngrpo_lightning.training.logprob_passes import LogprobPasses
from ngrpo_lightning.training.parallel import ParallelConfig, clip_grad_norm, most_over_ranks, rank_share, shard_fsdp2
from ngrpo_lightning.training.planning import DynamicSampling, UpdatePlan
from ngrpo_lightning.training.reports import StepReports
from ngrpo_lightning.training.settings import OptimConfig, TrainConfig
from ngrpo_lightning.training.updates import StepHook, StepRollouts

__all__ = ["RLModule"]


class RLModule(CheckpointHooks, StepReports, LogprobPasses, L.LightningModule):
    """Policy optimization of a causal LM with a pluggable explorer and objective.

    Args:
        policy: the causal LM being trained (a transformers ``PreTrainedModel``).
        tokenizer: its tokenizer.
        explorer: how training rollouts explore (the DataModule asks the module for it).
        objective: the policy loss.
        reward: maps (responses, gold answers) to scores and statuses.
        reference: frozen reference model for the KL term; required iff ``objective.kl_coef > 0``.
        optim: optimizer settings and micro-batching (``optim.*``).
        train: how rollouts become updates (``train.*``, :class:`~ngrpo_lightning.training.settings.TrainConfig`):
            PPO epochs x mini-batches, dynamic sampling, truncated importance sampling (``tis_*``), ``max_staleness``.
        advantage: group advantage estimator (a name registered with ``register_advantage``).
        eval_explorer: how validation rollouts sample (plain sampling; never mixing).
        detach_mixture: stop gradients into the embedding matrix through mixed inputs.
        parallel: FSDP2 settings (``trainer.parallel``), applied in ``configure_model``.
        seed: seed of the mini-batch shuffling.
        step_hooks: what takes part in every step, in order (callbacks among them join the Trainer).
        adapters: the policy is a peft model whose reference is itself with its adapters off.
        backend: how the models compute (:mod:`ngrpo_lightning.backends`; default: the policy device's, unprepared).
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
        train: TrainConfig | None = None,
        advantage: str = "grpo",
        eval_explorer: Explorer | None = None,
        detach_mixture: bool = False,
        parallel: ParallelConfig | dict | None = None,
        seed: int = 0,
        step_hooks: Sequence[StepHook] = (),
        adapters: bool = False,
        backend: Backend | None = None,
    ):
        super().__init__()
        self.backend = backend or backend_for(policy)
        self.automatic_optimization = False
        self.policy, self.tokenizer = policy, tokenizer
        self._recomputes: bool | None = None
        self.explorer, self.objective, self.reward = explorer, objective, reward
        self.eval_explorer = eval_explorer or TemperatureExplorer(temperature=0.0)
        self.optim = optim or OptimConfig()
        self.advantage, self.detach_mixture = advantage, detach_mixture
        # LoRA (`adapters`): the reference is the policy with its adapters switched off (lora.py)
        self.adapters = bool(adapters) and lora.has_adapters(policy)
        if adapters and not self.adapters:
            raise ValueError("adapters=True needs a peft model as the policy (model.lora.enabled=true)")
        if objective.needs_reference and reference is None and not self.adapters:
            raise ValueError(
                f"objective.kl_coef={objective.kl_coef} > 0 needs a reference model, but none was given "
                "(set objective.kl_coef=0 to train without one)"
            )
        self.reference = reference if objective.needs_reference and not self.adapters else None
        if self.reference is not None:
            self.reference.requires_grad_(False).eval()
        # checkpoints hold no reference weights (they are the base model's): its id and hash instead
        self.base_model: dict = {}
        self.register_load_state_dict_post_hook(reference_not_required)
        resolve_advantage(advantage)  # fail now on an unknown estimator name
        self.train_config = train = train or TrainConfig()
        self.tis_level = train.importance_level(objective)
        self.tis_cap, self.tis_mode = train.importance_cap, train.tis_mode
        self.plan = UpdatePlan.from_settings(train, self.optim, seed=seed)
        self.dynamic_sampling = DynamicSampling.from_settings(train) if train.dynamic_sampling else None
        self.step_hooks: list[StepHook] = list(step_hooks)
        self.update_metrics: list[dict[str, float]] = []  # per-update metrics of the last step (for inspection)
        self._fit_start = self._last_step_end = None
        self.val_accuracy = MeanMetric()
        self.val_reward = MeanMetric()
        self.parallel = ParallelConfig(**parallel) if isinstance(parallel, dict) else parallel
        self.run_meta: dict = {}  # what identifies the run in checkpoints (set by the CLI: config, MLflow run id)
        self._forwards: dict[int, torch.nn.Module] = {}  # FSDP2 root wrappers by id(model) (outside the module tree)
        self.policy_version = PolicyVersion()  # optimizer steps taken: weight syncs and staleness (rollout/context.py)

    # --------------------------------------------------------------- sharding
    def configure_model(self) -> None:
        """FSDP2 under ``ModelParallelStrategy``: ``fully_shard`` per decoder layer and at a root wrapper, for the
        policy and the reference. A no-op without a device mesh."""
        if self.parallel is None or self._forwards:
            return
        try:
            mesh = self.device_mesh
        except RuntimeError:
            mesh = None
        if mesh is None:
            return
        self._forwards = shard_fsdp2(
            [self.policy, self.reference], self.parallel, mesh["data_parallel"], checkpoint=self.policy
        )

    def sharded_root(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The FSDP2 root wrapper of ``model`` after ``configure_model`` sharded it, else ``None``."""
        return self._forwards.get(id(model))

    @property
    def context(self) -> RunContext:
        """The run as the DataModule and callbacks see it (:class:`~ngrpo_lightning.rollout.context.RunContext`)."""
        return RunContext(
            policy=self.policy,
            tokenizer=self.tokenizer,
            explorer=self.explorer,
            eval_explorer=self.eval_explorer,
            reward=self.reward,
            backend=self.backend,
            version=self.policy_version,
            update=self.plan,
            sharded_root=self.sharded_root,
            sharded=self.parallel is not None,
        )

    @classmethod
    def reference_from(cls, policy: torch.nn.Module) -> torch.nn.Module:
        """A frozen copy of the policy's initial weights, to serve as the KL reference."""
        return copy.deepcopy(policy).requires_grad_(False).eval()

    # ------------------------------------------------------------------ optim
    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]  # with adapters: theirs only
        opt, sched = self.optim.build(params, sharded=self.parallel is not None)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ------------------------------------------------------------------ train
    def configure_callbacks(self) -> list[L.Callback]:
        """The step hooks that are also Lightning callbacks (e.g. ``ReplayBuffer``)."""
        return [hook for hook in self.step_hooks if isinstance(hook, L.Callback)]

    def _models_on_device(self) -> None:
        """The backend's preparation of the unsharded policy and reference on their device (idempotent; a reference
        held in a file is left as it is)."""
        if self.parallel is None:
            self.backend.on_device(self.policy)
            if self.reference is not None and file_weights.weight_releaser(self.reference) is None:
                self.backend.on_device(self.reference, reference=True)

    def on_validation_start(self) -> None:
        self._models_on_device()  # a validation on its own (trainer.validate) rolls out too

    def on_fit_start(self) -> None:
        self._models_on_device()
        if self.trainer.world_size > 1:  # as many micro-batches on every rank (collectives), the global batch's mean
            self.plan.agree = partial(most_over_ranks, device=self.device)
            self.plan.rank_share = partial(rank_share, device=self.device)
        loose = [
            type(cb).__name__
            for cb in self.trainer.callbacks
            if isinstance(cb, StepHook) and all(cb is not h for h in self.step_hooks)
        ]
        if loose:  # a hook among the callbacks only would silently never be called
            raise ValueError(
                f"{loose[0]} takes part in training steps: give it to the module, "
                "RLModule(..., step_hooks=[...]), not only to the Trainer's callbacks"
            )
        if self.backend.share_prompts and not self._shares_prompts(self.policy):
            rank_zero_info(
                "prompt sharing is off under activation checkpointing (a recomputed layer would extend the "
                "shared prompt cache twice): each row runs its prompt, same values, more FLOPs"
            )

    def on_train_start(self) -> None:
        self._fit_start, self._last_step_end = time.perf_counter(), None
        self.first_step = self.trainer.global_step  # a resumed run's step at its checkpoint

    def score(self, batch: RolloutBatch):
        """Rewards of a rollout batch (a :class:`~ngrpo_lightning.rewards.RewardResult`)."""
        return score_responses(self.reward, batch.response_text, batch.answers, batch.verifiers)

    def training_step(self, batch: RolloutBatch, batch_idx: int):
        with self._phase("reward") as reward:
            scored = self.score(batch)
            rewards = scored.scores.to(self.device)
            step = self.collect(batch, rewards)
        with self._phase("logprobs") as logprobs:
            # one on-policy update takes old log-probs from its own forward, unless a hook weighs by them
            step = self.prepare(step, reuse_forward=self.plan.single and not bool(step.replayed.any()))
            for hook in self.step_hooks:
                step = hook.weigh(step)
        self.backend.release_memory()  # before the update, the step's peak (backends/freed_memory.py)
        with self._phase("update") as update:
            metrics, old_logp = self.optimize(self.plan.updates(step))
        if step.old_logp is None:  # the update's forward gave them: the step carries them on (metrics, replay)
            step = replace(step, old_logp=old_logp)
        # where a step's time goes (the rollout's own time is rollout/time_s)
        phases = {"time/reward_s": reward.seconds, "time/logprobs_s": logprobs.seconds, "time/update_s": update.seconds}
        self.log_step(batch, scored, rewards, step, metrics, phases)
        return {"rewards": rewards.detach().cpu(), "status": scored.status, "rollouts": step}

    def _phase(self, name: str):
        """A timed phase of the step (:mod:`~ngrpo_lightning.phases`), reported to the profiler."""
        trainer = self._attached_trainer()
        return phase(name, self.device, trainer.profiler if trainer is not None else None)

    def mix_in(self, batch: RolloutBatch, rewards: torch.Tensor) -> StepRollouts:
        """A scored rollout batch as a step, with the hooks' stored trajectories mixed in."""
        step = StepRollouts.fresh(batch, rewards, self.tokenizer.pad_token_id or 0)
        for hook in self.step_hooks:
            step = hook.mix_in(step)
        return step

    def collect(self, batch: RolloutBatch, rewards: torch.Tensor) -> StepRollouts:
        """The rollouts this step trains on: the batch with the hooks' trajectories mixed in and, under dynamic
        sampling, zero-variance groups replaced from the DataModule's ``more_rollouts()``."""
        step = self.mix_in(batch, rewards)
        if self.dynamic_sampling is None:
            return step

        def more() -> StepRollouts:
            extra = self._more_rollouts()
            return self.mix_in(extra, self.score(extra).scores.to(self.device))

        return self.dynamic_sampling.fill(step, more, self.plan.agree)

    def _more_rollouts(self) -> RolloutBatch:
        datamodule = getattr(self._attached_trainer(), "datamodule", None)
        if not hasattr(datamodule, "more_rollouts"):
            raise RuntimeError(
                "train.dynamic_sampling=true needs a datamodule with more_rollouts() "
                "(ngrpo_lightning.rollout.RolloutDataModule), passed as trainer.fit(..., datamodule=...)"
            )
        return datamodule.more_rollouts()

    @torch.no_grad()
    def prepare(self, step: StepRollouts, reuse_forward: bool = False) -> StepRollouts:
        """The step with its advantages, old (proximal) log-probs and reference log-probs. With ``reuse_forward`` (one
        on-policy update per step) the old log-probs stay ``None``: :meth:`optimize` takes them, detached, from the
        update's own forward, which computes the same."""
        ref_logp = None
        if self.reference is not None:
            with file_weights.materialized(self.reference):  # a file-backed reference is in memory only meanwhile
                with self._packed(self.reference, step.batch):
                    ref_logp = self._logprobs_no_grad(self.reference, step.batch)
        elif self.adapters and self.objective.needs_reference:
            with lora.adapters_off(self.policy):  # the base model: the policy without its adapters
                with self._packed(self.policy, step.batch):
                    ref_logp = self._logprobs_no_grad(self.policy, step.batch)
        return replace(
            step,
            advantages=group_advantages(step.rewards, step.group_size, self.advantage),
            old_logp=None if reuse_forward else self._policy_logprobs_no_grad(step.batch),
            ref_logp=ref_logp,
        )

    def optimize(self, updates: list[StepRollouts]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """One optimizer and lr scheduler step per update. Returns the updates' combined metrics and, for a single
        update prepared with ``reuse_forward``, the old log-probs [N, L] (else ``None``)."""
        opt, sched = self.optimizers(), self.lr_schedulers()
        temperature = self.explorer.temperature or 1.0
        self.update_metrics = []
        reused = None
        for update in updates:
            opt.zero_grad(set_to_none=True)
            if update.old_logp is None:  # micro-batches may group rows by length: each row's goes back in place
                assert len(updates) == 1, "old log-probs come from the update's forward only for a single update"
                reused = torch.zeros_like(update.batch.rollout_logprobs)
            metrics = self._accumulate_gradients(update, temperature, reused)
            # the optimizer's parameters, the trained ones: not a walk over every module (thousands with LoRA)
            trained = [p for group in opt.param_groups for p in group["params"]]
            metrics["grad_norm"] = clip_grad_norm(trained, self.optim.grad_clip or math.inf)
            opt.step()
            opt.zero_grad(set_to_none=True)  # freed now: until the next update no pass needs them
            sched.step()
            self.policy_version.advance()
            self.update_metrics.append(host_floats(metrics))
        out = combine_metrics(self.update_metrics, [1.0 / len(updates)] * len(updates))
        out["updates"] = len(updates)
        return out, reused

    def _accumulate_gradients(self, update: StepRollouts, temperature: float, reused: torch.Tensor | None) -> dict:
        """Forward and backward of ``update``, one micro-batch at a time; returns its metrics. Where the update has no
        old log-probs, its forward's go into ``reused``."""
        parts, weights = [], []
        if self._recomputes is None:  # whether the backend swapped in recomputing modules (backends/recompute.py)
            self._recomputes = recomputes(self.policy)
        for rows, weight in self.plan.micro_batches(update.batch, self.objective.loss_agg == "token-mean"):
            mb = update.select(rows) if len(rows) < len(update) else update
            with recomputing(self._recomputes):  # the policy's cheap activations recomputed in backward
                logp, entropy = self._logprobs(
                    self.policy, mb.batch, temperature, with_entropy=True, detach_mixture=self.detach_mixture
                )
            old_logp = mb.old_logp
            if old_logp is None:
                old_logp = logp.detach()
                reused[rows.to(old_logp.device)] = old_logp
            advantages, tis = self._tis_advantages(mb, old_logp)
            loss, m = self.objective(logp, old_logp, mb.ref_logp, advantages, mb.batch.response_mask)
            self.manual_backward(loss * weight)
            parts.append({**m, **tis, "loss": loss, "entropy": masked_mean(entropy, mb.batch.response_mask)})
            weights.append(weight)
        return combine_metrics(parts, weights)

    def _tis_advantages(self, mb: StepRollouts, old_logp: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Advantages weighted by fresh rows' importance ratio ``p_train_old / p_rollout``, capped at ``tis_cap``
        (``tis_mode``, ``tis_level``); replayed rows get weight 1."""
        if self.tis_cap is None:
            return mb.advantages, {}
        weights, stats = rollout_importance_weights(
            old_logp, mb.batch.rollout_logprobs, mb.batch.response_mask, ~mb.replayed, self.tis_cap,
            self.tis_level, self.tis_mode,
        )  # fmt: skip
        return (mb.advantages[:, None] * weights if self.tis_level == "token" else mb.advantages * weights), stats
