"""RolloutDataModule: a LightningDataModule whose batches are rollouts of the current policy.

The dataloaders yield batches of tokenized prompts; ``on_after_batch_transfer`` (a
DataModule hook Lightning calls on every batch, after moving it to the device) turns each
into a :class:`RolloutBatch` by rolling out the *current* policy with the configured
engine: the training explorer and G samples per prompt in training, plain sampling and
``val_samples`` per prompt in validation.

:meth:`RolloutDataModule.more_rollouts` rolls out one more training prompt batch on
demand, outside the dataloader: the module's dynamic sampling (DAPO) calls it to refill
a batch that lost its zero-variance groups.

With ``max_staleness = k > 0`` training batches are rolled out ``k`` steps ahead, on a worker
thread with its own copy of the policy (:mod:`.ahead`): the rollouts of step ``b`` come from
the weights after step ``b - k`` while steps ``b - k .. b - 1`` train.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader

from ngrpo_lightning.checks import check_number
from ngrpo_lightning.data import PromptDataset, collate_prompts
from ngrpo_lightning.rollout.ahead import RolloutsAhead, trainable_snapshot
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.rollout.engine import RolloutEngine, full_named_tensors
from ngrpo_lightning.rollout.engines import build_engine, engine_class
from ngrpo_lightning.rollout.prompt_order import PromptLoader, PromptSampler


class RolloutDataModule(L.LightningDataModule):
    """Prompts in, rollouts of the current policy out.

    What it reads from the trainer's LightningModule (``RLModule`` provides each): ``policy``
    and ``tokenizer`` (the engine is built for them), ``explorer`` and ``eval_explorer`` (training
    and validation rollouts), ``policy_version`` (optimizer steps taken: an engine with its own
    weights syncs when it changes) and ``sharded_root(policy)`` (the FSDP2 root, or None).

    Args:
        tokenizer: renders and tokenizes prompts.
        train_problems / val_problems: lists of :class:`~ngrpo_lightning.data.Problem`.
        prompts_per_step: prompts per training batch (each rolled out ``group_size`` times).
        group_size: G, samples per prompt in training.
        max_new_tokens: response length limit.
        max_prompt_tokens: longer prompts are dropped (and counted).
        val_samples: samples per validation prompt.
        val_batch_size: validation prompts per batch.
        engine: ``hf`` (default), ``vllm``, another registered engine or an engine's class path.
        engine_kwargs: the engine's own settings (``rollout.hf.*``, ``rollout.vllm.*``).
        ignore_eos: every response is ``max_new_tokens`` long (fixed-length rollouts, for benchmarks).
        instruction / system_prompt: prompt rendering (see :mod:`ngrpo_lightning.data.prompts`).
        seed: shuffling and sampling seed.
        max_staleness: roll training batches out this many steps ahead of the step that trains
            on them (``train.max_staleness``; 0 = each step rolls out its own batch first).
        ahead_threads: intra-op threads of that rollout worker (default: the module's backend's).
    """

    def __init__(
        self,
        tokenizer,
        train_problems: Sequence,
        val_problems: Sequence = (),
        prompts_per_step: int = 8,
        group_size: int = 4,
        max_new_tokens: int = 256,
        max_prompt_tokens: int = 4096,
        val_samples: int = 1,
        val_batch_size: int = 32,
        engine: str = "hf",
        engine_kwargs: dict | None = None,
        ignore_eos: bool = False,
        instruction: str | None = None,
        system_prompt: str | None = None,
        seed: int = 0,
        shuffle: bool = True,
        max_staleness: int = 0,
        ahead_threads: int | None = None,
    ):
        super().__init__()
        engine_class(engine)  # an unknown engine fails here, naming rollout.engine and the allowed names
        check_number("ahead_threads", ahead_threads, 1, integer=True, optional=True)
        if group_size < 1 or prompts_per_step < 1:
            raise ValueError(
                f"rollout.group_size ({group_size}) and data.prompts_per_step ({prompts_per_step}) must be >= 1"
            )
        self.tokenizer = tokenizer
        self.train_problems, self.val_problems = list(train_problems), list(val_problems)
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.max_new_tokens, self.max_prompt_tokens = max_new_tokens, max_prompt_tokens
        self.val_samples, self.val_batch_size = val_samples, val_batch_size
        self.engine_name, self.engine_kwargs, self.ignore_eos = engine, engine_kwargs or {}, ignore_eos
        self.prompt_kwargs = {
            k: v for k, v in {"instruction": instruction, "system_prompt": system_prompt}.items() if v is not None
        }
        self.seed, self.shuffle = seed, shuffle
        self.max_staleness = int(max_staleness)
        self.engine: RolloutEngine | None = None
        self.ahead: RolloutsAhead | None = None  # the worker of max_staleness > 0
        self._ahead_state: dict | None = None
        self.ahead_threads = ahead_threads
        self._sampler: PromptSampler | None = None
        self.train_set = self.val_set = None
        self.extra_prompts_drawn = 0  # position in the stream of more_rollouts()
        self.epoch, self.batches_in_epoch = 0, 0  # data position: training batches rolled out in the current epoch
        self._resume_position: tuple[int, int] | None = None
        self._engine_state: dict | None = None

    # ------------------------------------------------------------- datasets
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set = self._dataset(self.train_problems)
            self.val_set = self._dataset(self.val_problems) if self.val_problems else None

    def _dataset(self, problems):
        return PromptDataset(problems, self.tokenizer, max_prompt_tokens=self.max_prompt_tokens, **self.prompt_kwargs)

    def _rank(self) -> tuple[int, int]:
        """(rank, world size) of this process (0, 1 outside a distributed Trainer)."""
        trainer = getattr(self, "trainer", None)
        return int(getattr(trainer, "global_rank", 0)), int(getattr(trainer, "world_size", 1))

    def train_dataloader(self) -> DataLoader:
        """This rank's prompts, ``prompts_per_step`` per batch (the global batch is
        ``prompts_per_step x world_size`` prompts). The order is a shuffle seeded by
        ``seed + epoch``; a resumed run continues at its saved position."""
        rank, world = self._rank()
        epoch, batches = self._resume_position or (0, 0)
        self._resume_position = None
        sampler = PromptSampler(
            len(self.train_set),
            self.seed,
            self.shuffle,
            rank,
            world,
            self.prompts_per_step,
            epoch=epoch,
            skip=batches * self.prompts_per_step,
            on_pass=self._start_pass,
        )
        self._sampler = sampler
        return PromptLoader(
            self.train_set,
            batch_size=self.prompts_per_step,
            sampler=sampler,
            drop_last=len(sampler) >= self.prompts_per_step,
            collate_fn=collate_prompts,
        )

    def _start_pass(self, epoch: int, batches_skipped: int) -> None:
        self.epoch, self.batches_in_epoch = epoch, batches_skipped

    def val_dataloader(self) -> DataLoader:
        if self.val_set is None or len(self.val_set) == 0:
            return []
        rank, world = self._rank()
        sampler = PromptSampler(len(self.val_set), self.seed, False, rank, world, 1)
        sampler.per_rank = math.ceil(len(self.val_set) / world)  # all prompts (a few twice when uneven)
        return DataLoader(self.val_set, batch_size=self.val_batch_size, sampler=sampler, collate_fn=collate_prompts)

    # ------------------------------------------------------------- rollouts
    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if isinstance(batch, RolloutBatch):
            return batch
        module = self.trainer.lightning_module
        if self.trainer.training:
            key = (self.epoch, self.batches_in_epoch)
            self.batches_in_epoch += 1  # the data position saved in checkpoints
            if self.max_staleness:
                return self.rollout_ahead(key, batch)
            return self.rollout(batch, module.explorer, self.group_size)
        return self.rollout(batch, module.eval_explorer, self.val_samples)

    # ------------------------------------------------ rollouts ahead (max_staleness > 0)
    def rollout_ahead(self, key: tuple[int, int], prompts: dict) -> RolloutBatch:
        """The rollouts of training batch ``key`` = (pass, index), rolled out ahead; queues the
        batches of the next ``max_staleness`` steps with the current weights first."""
        module, ahead = self.trainer.lightning_module, self.ensure_ahead()
        version, weights = self.trainer.global_step, None  # optimizer steps of the run (a resumed one too)
        for k, p in [(key, prompts), *self._upcoming(key)]:
            if not ahead.queued(k):  # jobs queued together share one copy of the weights
                weights = weights if weights is not None else trainable_snapshot(module.policy)
                ahead.submit(k, self._generation(p, module.explorer, self.group_size), weights, version)
        batch = ahead.take(key)
        if batch.problem_ids != [i for i in prompts["id"] for _ in range(self.group_size)]:
            raise RuntimeError(
                f"the rollouts restored for training batch {key} are of other prompts: the checkpoint's "
                "data settings (data.*, seed) differ from this run's"
            )
        batch.stats["async/staleness"] = float(version - batch.stats["async/weights_version"])
        return batch

    def _upcoming(self, key: tuple[int, int]) -> list[tuple[tuple[int, int], dict]]:
        """The next ``max_staleness`` training batches after ``key``, by (pass, index), within
        the run's steps (``trainer.max_steps``)."""
        if self._sampler is None:  # a loader not made by train_dataloader(): nothing to look ahead in
            return []
        per_pass = len(self._sampler) // self.prompts_per_step if len(self._sampler) >= self.prompts_per_step else 1
        ahead = self.max_staleness
        max_steps, module = self.trainer.max_steps, self.trainer.lightning_module
        if max_steps is not None and max_steps > 0:
            updates = module.plan.updates_per_step
            ahead = min(ahead, math.ceil(max_steps / updates) - self.trainer.global_step // updates - 1)
        out = []
        epoch, index = key
        for _ in range(max(ahead, 0)):
            epoch, index = (epoch, index + 1) if index + 1 < per_pass else (epoch + 1, 0)
            rows = self._sampler.order(epoch)[index * self.prompts_per_step : (index + 1) * self.prompts_per_step]
            out.append(((epoch, index), collate_prompts([self.train_set[i] for i in rows])))
        return out

    def ensure_ahead(self) -> RolloutsAhead:
        """The rollout worker (built at the first training batch): a copy of the policy, an engine
        of the configured kind on it, and ``ahead_threads`` intra-op threads of its own (the
        training thread keeps its own: measured on 2 cores, halving them slowed the step 1.2-1.35x
        while the worker idled, docs/async.md)."""
        if self.ahead is None:
            module = self.trainer.lightning_module
            threads = self.ahead_threads or getattr(getattr(module, "backend", None), "ahead_threads", 1)
            self.ahead = RolloutsAhead(module.policy, lambda model: self._build_engine(model, module), threads)
            if self._ahead_state is not None:
                self.ahead.load_state_dict(self._ahead_state)
                self._ahead_state = None
        return self.ahead

    def close_ahead(self) -> None:
        """Stop the rollout worker (rollouts queued beyond the run are dropped)."""
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None

    def ensure_engine(self) -> RolloutEngine:
        """The rollout engine, built at the first rollout for the trainer's module (its
        ``policy``, ``tokenizer`` and, under FSDP2, ``sharded_root(policy)``), with the sampling
        state of a resumed checkpoint."""
        if self.engine is None:
            module = self.trainer.lightning_module
            self.engine = self._build_engine(module.policy, module, module.sharded_root(module.policy))
            if self._engine_state is not None:
                self.engine.load_state_dict(self._engine_state)
            self._engine_state = None
        return self.engine

    def _build_engine(self, model, module, sharded_root=None) -> RolloutEngine:
        return build_engine(
            self.engine_name,
            model,
            module.tokenizer,
            max_new_tokens=self.max_new_tokens,
            seed=self.seed + self._rank()[0],
            ignore_eos=self.ignore_eos,
            max_prompt_tokens=self.max_prompt_tokens,
            sharded_root=sharded_root,
            **self.engine_kwargs,
        )

    def more_rollouts(self) -> RolloutBatch:
        """Roll out one more batch of ``prompts_per_step`` training prompts with the training
        explorer (``group_size`` samples each), outside the dataloader.

        Prompts come from a second stream over the training set: seeded shuffles, one per
        pass, independent of the dataloader's order. Its position (``extra_prompts_drawn``)
        is saved in checkpoints, so a resumed run draws the same prompts.
        """
        module = self.trainer.lightning_module
        self.setup("fit")
        size, count = len(self.train_set), self.prompts_per_step
        rows: list[int] = []
        while len(rows) < count:
            shuffle, start = divmod(self.extra_prompts_drawn, size)
            order = torch.randperm(size, generator=torch.Generator().manual_seed(self.seed + 7919 * (shuffle + 1)))
            take = order[start : start + count - len(rows)].tolist()
            rows += take
            self.extra_prompts_drawn += len(take)
        prompts = collate_prompts([self.train_set[i] for i in rows])
        if self.max_staleness:  # the worker owns the training explorer and its generator: it rolls out, now
            batch = self.ensure_ahead().run_now(
                self._generation(prompts, module.explorer, self.group_size),
                trainable_snapshot(module.policy),
                self.trainer.global_step,
            )
            batch.stats["async/staleness"] = 0.0
            return batch
        return self.rollout(prompts, module.explorer, self.group_size)

    def rollout(self, prompts: dict, explorer, n: int) -> RolloutBatch:
        """Roll out a collated prompt batch ``n`` times each and attach gold answers and ids."""
        self.ensure_engine()
        self.sync_engine()
        return self._generation(prompts, explorer, n)(self.engine)

    def _generation(self, prompts: dict, explorer, n: int) -> Callable[[RolloutEngine], RolloutBatch]:
        """The rollout of a collated prompt batch (``n`` samples each, with gold answers and ids)
        by a given engine."""

        def generate(engine: RolloutEngine) -> RolloutBatch:
            out = engine.generate(prompts["prompt_ids"], explorer, n=n, max_new_tokens=self.max_new_tokens)
            out.answers = [a for a in prompts["answer"] for _ in range(n)]
            out.verifiers = [v for v in prompts.get("verifier", [None] * len(prompts["answer"])) for _ in range(n)]
            out.problem_ids = [i for i in prompts["id"] for _ in range(n)]
            return out

        return generate

    def sync_engine(self) -> None:
        """Give an engine with its own weights (vLLM) the policy's current weights if the
        policy took optimizer steps since the last sync: every rollout sees the weights of
        the latest optimizer step. Under FSDP2 the full tensors are gathered (a collective:
        every rank rolls out, so every rank syncs)."""
        module = self.trainer.lightning_module
        version = module.policy_version
        if self.engine.needs_sync and self.engine.weights_version != version:
            self.engine.sync_weights(full_named_tensors(module.policy), version=version)

    def teardown(self, stage: str | None = None) -> None:
        """The engine outlives ``fit``: a validation after training (``ngrpo train`` runs one)
        reuses it, since starting vLLM again costs seconds. :meth:`close` releases it. The
        rollout worker of ``max_staleness`` stops with ``fit``."""
        if stage == "fit":
            self.close_ahead()

    def close(self) -> None:
        """Release the rollout engine (vLLM's memory and threads)."""
        self.close_ahead()
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # ------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        """Seed, data position (epoch and batches rolled out in it), the extra-prompt stream's
        position and the engine's sampling RNG; with ``max_staleness`` the rollouts in flight
        (waited for) and the worker engine's RNG after them, so that a resumed run trains on them.
        Under several processes each rank's engine has its own RNG: the states of all ranks are
        saved (gathered), each rank restores its own."""
        engine = self.engine.state_dict() if self.engine is not None else self._engine_state
        rank, world = self._rank()
        engines = [engine]
        if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            engines = [None] * world
            torch.distributed.all_gather_object(engines, engine)
        return {
            "seed": self.seed,
            "extra_prompts_drawn": self.extra_prompts_drawn,
            "epoch": self.epoch,
            "batches_in_epoch": self.batches_in_epoch,
            "engine": engines,
            "world_size": world,
            "ahead": self.ahead.state_dict() if self.ahead is not None else self._ahead_state,
        }

    def load_state_dict(self, state: dict) -> None:
        self.seed = state.get("seed", self.seed)
        self.extra_prompts_drawn = state.get("extra_prompts_drawn", 0)
        if "epoch" in state:
            self._resume_position = (int(state["epoch"]), int(state["batches_in_epoch"]))
            self.epoch, self.batches_in_epoch = self._resume_position
        rank, world = self._rank()
        saved_world = state.get("world_size", 1)
        if saved_world != world:
            raise ValueError(
                f"the checkpoint was made by {saved_world} process(es), this run has {world}: "
                "resume with the same trainer (number of devices)"
            )
        self._ahead_state = state.get("ahead") if self.max_staleness else None
        if self.ahead is not None and self._ahead_state is not None:
            self.ahead.load_state_dict(self._ahead_state)
            self._ahead_state = None
        engines = state.get("engine") or [None]
        self._engine_state = engines[rank] if rank < len(engines) else None
        if self.engine is not None and self._engine_state is not None:
            self.engine.load_state_dict(self._engine_state)
            self._engine_state = None
