"""Pass@k evaluation of the current policy during training."""

from __future__ import annotations

import lightning as L
import torch

from ngrpo_lightning.checks import check_number
from ngrpo_lightning.explorers import TemperatureExplorer
from ngrpo_lightning.metrics.evaluate import RewardCache, as_eval_sets, check_ks, evaluate_sets, log_artifacts
from ngrpo_lightning.rollout import HFEngine
from ngrpo_lightning.rollout.context import run_context
from ngrpo_lightning.tracking.logger import mlflow_key


class PassAtK(L.Callback):
    """Every ``every_n_steps`` training steps and at the end of fit, sample each problem of the
    sets ``n`` times with plain sampling (never exploration) and log

    * ``<prefix>/<set>/pass@k`` for k = 1, 2, 4, ... up to n (or ``ks``), ``mean@n``, ``maj@n``,
      and their averages ``<prefix>/avg/...`` (in MLflow ``pass@4`` is ``pass_at_4``);
    * an MLflow artifact folder ``pass_at_k/step_<step>/`` with the table and the pass@k plot.

    The metrics go through ``pl_module.log``, so ``ModelCheckpoint(monitor="val/aime24/pass@1")``
    can keep the best checkpoint. Rollouts use the DataModule's engine when it holds its own weights
    (vLLM), else an :class:`~ngrpo_lightning.rollout.HFEngine` with its own seed. Under DDP/FSDP each
    process samples a share of the problems.

    Args:
        datasets: ``{name: problems}``, a list of :class:`~ngrpo_lightning.metrics.evaluate.EvalSet`
            (per-set instruction and answer format), or a list of problems (named ``val``).
        n: samples per problem.
        every_n_steps: evaluate after every N training steps (rollout batches); 0 = only at the end.
        at_fit_end: evaluate after the last training step.
        max_new_tokens: response limit (default: the DataModule's, else 256).
        batch_size: prompts per generate call (x ``n`` samples).
        reward: scores samples (default: the module's reward for sets of its answer format,
            a ``MathReward`` of the set's format otherwise).
        prefix: metric name prefix.
        seed: sampling seed of the evaluation engine.
    """

    def __init__(
        self,
        datasets,
        n: int = 8,
        every_n_steps: int = 0,
        at_fit_end: bool = True,
        temperature: float = 0.6,
        top_p: float = 0.95,
        top_k: int = 0,
        max_new_tokens: int | None = None,
        batch_size: int = 8,
        ks=None,
        reward=None,
        prefix: str = "val",
        seed: int = 1234,
        log_artifacts: bool = True,
    ):
        self.sets = as_eval_sets(datasets)
        if not self.sets or any(not s.problems for s in self.sets):
            raise ValueError("PassAtK needs at least one evaluation set with problems")
        check_number("pass_at_k.every_n_steps", every_n_steps, 0, integer=True)
        check_number("pass_at_k.batch_size", batch_size, 1, integer=True)
        self.n, self.ks = n, check_ks(ks, n)
        self.explorer = TemperatureExplorer(temperature=temperature, top_k=top_k, top_p=top_p)
        self.every_n_steps, self.at_fit_end = every_n_steps, at_fit_end
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.reward, self.prefix, self.seed, self.log_artifacts = reward, prefix, seed, log_artifacts
        self.batches_seen = 0
        self.last_eval_step: int | None = None
        self.history: list[dict] = []  # {"step", "metrics"} of every evaluation
        self.last_results: dict | None = None
        self._engine = self._rewards = None

    def metric_names(self) -> list[str]:
        """The metrics an evaluation logs, as Lightning names them (``val/aime24/pass@16``)."""
        keys = [f"pass@{k}" for k in self.ks] + [f"mean@{self.n}", f"maj@{self.n}"]
        return [f"{self.prefix}/{name}/{key}" for name in [s.name for s in self.sets] + ["avg"] for key in keys]

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"batches_seen": self.batches_seen, "last_eval_step": self.last_eval_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.batches_seen = int(state_dict.get("batches_seen", 0))
        self.last_eval_step = state_dict.get("last_eval_step")

    # ----------------------------------------------------------------- hooks
    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.batches_seen += 1
        periodic = self.every_n_steps and self.batches_seen % self.every_n_steps == 0
        if periodic or (self.at_fit_end and self._is_last_step(trainer)):
            self.evaluate(trainer, pl_module, log_to_module=True)

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        # fit stopped early: evaluate the final policy (no self.log in this hook: logger and callback_metrics)
        if self.at_fit_end and self.last_eval_step != trainer.global_step:
            self.evaluate(trainer, pl_module, log_to_module=False)

    def teardown(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if self._rewards is not None:
            self._rewards.close()
        self._engine = self._rewards = None

    @staticmethod
    def _is_last_step(trainer: L.Trainer) -> bool:
        if trainer.max_steps is not None and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            return True
        max_epochs = trainer.max_epochs
        return bool(
            trainer.is_last_batch
            and max_epochs is not None
            and max_epochs > 0
            and trainer.current_epoch + 1 >= max_epochs
        )

    # ------------------------------------------------------------ evaluation
    def _engine_for(self, trainer: L.Trainer, pl_module):
        datamodule = getattr(trainer, "datamodule", None)
        engine = getattr(datamodule, "engine", None)
        if engine is not None and getattr(engine, "needs_sync", False):
            datamodule.sync_engine()  # an engine with its own weights copy (vLLM): the latest optimizer step's
            return engine
        context = run_context(trainer)
        if self._engine is None or self._engine.model is not context.policy:
            self._engine = HFEngine(
                context.policy,
                context.tokenizer,
                max_new_tokens=self._max_new(trainer),
                seed=self.seed,
                backend=context.backend,
                sharded_root=context.sharded_root(context.policy),  # FSDP2's root: gathered with the layers
            )
        # an FSDP2 policy's decoding copy is rewritten only when the version moved
        self._engine.policy_version = context.version.value
        return self._engine

    def _max_new(self, trainer: L.Trainer) -> int:
        return self.max_new_tokens or getattr(getattr(trainer, "datamodule", None), "max_new_tokens", None) or 256

    def evaluate(self, trainer: L.Trainer, pl_module, log_to_module: bool = True) -> dict:
        """Evaluate now and log; returns the results (see :func:`~ngrpo_lightning.metrics.evaluate.evaluate_sets`)."""
        context = run_context(trainer)
        if self._rewards is None:
            self._rewards = RewardCache(default=self.reward if self.reward is not None else context.reward)
        datamodule = getattr(trainer, "datamodule", None)
        results = evaluate_sets(
            self._engine_for(trainer, pl_module),
            context.tokenizer,
            self.sets,
            self.explorer,
            n=self.n,
            max_new_tokens=self._max_new(trainer),
            rewards=self._rewards,
            batch_size=self.batch_size,
            ks=self.ks,
            prefix=self.prefix,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            prompt_defaults=getattr(datamodule, "prompt_kwargs", None),
            device=context.device,
        )
        step = trainer.global_step
        metrics = results["metrics"]
        if log_to_module:
            for key, value in metrics.items():
                pl_module.log(key, value, on_step=True, on_epoch=False, logger=False, batch_size=1)
        # now, not after the hook: later callbacks of this hook read them (best.ckpt by a Pass@k metric)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        logger = trainer.logger
        if logger is not None and trainer.is_global_zero:
            logger.log_metrics({mlflow_key(k): v for k, v in metrics.items()}, step=step)
            if self.log_artifacts:
                log_artifacts(logger, results, f"pass_at_k/step_{step:06d}")
        self.last_eval_step, self.last_results = step, results
        self.history.append({"step": step, "metrics": dict(metrics)})
        return results
