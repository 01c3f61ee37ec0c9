"""RolloutDataModule: a LightningDataModule whose batches are rollouts of the current policy.

The dataloaders yield tokenized prompts; ``on_after_batch_transfer`` turns each batch into a :class:`RolloutBatch` of
the *current* policy: the training explorer and G samples per prompt in training, plain sampling and ``val_samples``
per prompt in validation. :meth:`RolloutDataModule.more_rollouts` rolls out one more training batch on demand (DAPO's
dynamic sampling). With ``max_staleness = k > 0`` training batches are rolled out ``k`` steps ahead on a worker
thread with its own copy of the policy (:mod:`.ahead`): step ``b``'s rollouts come from the weights after step
``b - k``; an engine with weights of its own (vLLM) is shared, its other rollouts waiting for the worker.

It composes :class:`~.prompt_order.PromptStream`, :class:`~.policy_engine.PolicyEngine` and
:class:`~.ahead.RolloutsAhead`, reading the run from the trainer's :class:`~.context.RunContext`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader

from ngrpo_lightning.checks import check_number
from ngrpo_lightning.data import PromptDataset, collate_prompts
from ngrpo_lightning.phases import phase
from ngrpo_lightning.rollout.ahead import RolloutsAhead
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.rollout.context import run_context
from ngrpo_lightning.rollout.engine import RolloutEngine
from ngrpo_lightning.rollout.policy_engine import PolicyEngine, by_rank
from ngrpo_lightning.rollout.prompt_order import Key, PromptLoader, PromptStream, RankShare


class RolloutDataModule(L.LightningDataModule):
    """Prompts in, rollouts of the current policy out.

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
        max_staleness: roll training batches out this many steps ahead (``train.max_staleness``; 0: none).
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
        settings = {**(engine_kwargs or {}), "ignore_eos": ignore_eos, "max_prompt_tokens": max_prompt_tokens}
        self.engines = PolicyEngine(engine, settings, max_new_tokens, seed, self._rank)
        self.prompt_kwargs = {
            k: v for k, v in {"instruction": instruction, "system_prompt": system_prompt}.items() if v is not None
        }
        self.seed, self.shuffle = seed, shuffle
        self.max_staleness = int(max_staleness)
        self.ahead: RolloutsAhead | None = None  # the worker of max_staleness > 0
        self._ahead_state: dict | None = None
        self.ahead_threads = ahead_threads
        self.stream: PromptStream | None = None  # the training prompts' order (train_dataloader)
        self._position: dict | None = None  # a checkpoint's data position, until the stream exists
        self.train_set = self.val_set = None
        self.extra_prompts_drawn = 0  # position in the stream of more_rollouts()

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

    @property
    def engine(self) -> RolloutEngine | None:
        """The engine of this process's rollouts (None until the first)."""
        return self.engines.engine

    def train_dataloader(self) -> DataLoader:
        """This rank's prompts, ``prompts_per_step`` per batch, from the :class:`PromptStream` (a shuffle seeded by
        ``seed + pass``); a resumed run continues at its saved position."""
        rank, world = self._rank()
        self.stream = PromptStream(len(self.train_set), self.seed, self.shuffle, self.prompts_per_step, rank, world)
        if self._position is not None:
            self.stream.load_state_dict(self._position)
            self._position = None
        return PromptLoader(self.train_set, self.stream)

    def val_dataloader(self) -> DataLoader:
        if self.val_set is None or len(self.val_set) == 0:
            return []
        sampler = RankShare(len(self.val_set), *self._rank())
        return DataLoader(self.val_set, batch_size=self.val_batch_size, sampler=sampler, collate_fn=collate_prompts)

    # ------------------------------------------------------------- rollouts
    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if isinstance(batch, RolloutBatch):
            return batch
        context = run_context(self.trainer)
        if not self.trainer.training:
            with phase("validation_rollout", profiler=self.trainer.profiler):
                return self.rollout(batch, context.eval_explorer, self.val_samples)
        key = batch.pop("key", None)
        if key is not None and self.stream is not None:
            self.stream.consumed(key)  # the data position saved in checkpoints
        # the engine reads the rollout's tokens back at its end: no wait for the device needed
        with phase("rollout", profiler=self.trainer.profiler):
            if self.max_staleness and key is not None:
                return self.rollout_ahead(key, batch)
            return self.rollout(batch, context.explorer, self.group_size)

    # ------------------------------------------------ rollouts ahead (max_staleness > 0)
    def rollout_ahead(self, key: Key, prompts: dict) -> RolloutBatch:
        """The rollouts of training batch ``key``; queues the next ``max_staleness`` steps' batches (within
        ``trainer.max_steps``) with the current weights."""
        context, ahead = run_context(self.trainer), self.ensure_ahead()
        upcoming = self.stream.following(key, self._steps_ahead(context))

        def job(k: Key):
            batch = prompts if k == key else collate_prompts([self.train_set[i] for i in self.stream.rows(k)])
            return self._generation(batch, context.explorer, self.group_size)

        batch = ahead.rollouts_for(key, upcoming, job, ahead.snapshot, context.version.value)
        if batch.problem_ids != [i for i in prompts["id"] for _ in range(self.group_size)]:  # restored ones
            raise RuntimeError(
                f"the rollouts restored for training batch {key} are of other prompts: the checkpoint's "
                "data settings (data.*, seed) differ from this run's"
            )
        return batch

    def _steps_ahead(self, context) -> int:
        """``max_staleness``, or fewer near the end of the run (``trainer.max_steps``)."""
        ahead, max_steps = self.max_staleness, self.trainer.max_steps
        if max_steps is not None and max_steps > 0:
            updates = context.update.updates_per_step
            ahead = min(ahead, math.ceil(max_steps / updates) - context.version.value // updates - 1)
        return max(ahead, 0)

    def ensure_ahead(self) -> RolloutsAhead:
        """The rollout worker (built at the first training batch): a copy of the policy, an engine on it (vLLM's is
        the run's, not started twice) and ``ahead_threads`` intra-op threads of its own (docs/async.md)."""
        if self.ahead is None:
            context = run_context(self.trainer)
            threads = self.ahead_threads or context.backend.ahead_threads
            shared = self.engines.ready(context) if self.engines.needs_sync else None
            self.ahead = RolloutsAhead(
                context.policy,
                lambda model: self.engines.build(model, context),
                threads,
                shared_engine=shared,
                backend=context.backend,
                sharded_root=context.sharded_root(context.policy),
            )
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
        """The engine, synced to the policy version (:meth:`PolicyEngine.ready`); a shared one once the worker idles."""
        if self.ahead is not None and self.ahead.shared:
            self.ahead.settle()
        return self.engines.ready(run_context(self.trainer))

    def more_rollouts(self) -> RolloutBatch:
        """Roll out one more batch of ``prompts_per_step`` training prompts with the training explorer, from a second
        stream of seeded shuffles (every rank draws the same ``prompts_per_step x world_size`` and rolls out its
        share; ``extra_prompts_drawn`` is checkpointed)."""
        context = run_context(self.trainer)
        self.setup("fit")
        rank, world = self._rank()
        size, count = len(self.train_set), self.prompts_per_step * world
        rows: list[int] = []
        while len(rows) < count:
            shuffle, start = divmod(self.extra_prompts_drawn, size)
            order = torch.randperm(size, generator=torch.Generator().manual_seed(self.seed + 7919 * (shuffle + 1)))
            take = order[start : start + count - len(rows)].tolist()
            rows += take
            self.extra_prompts_drawn += len(take)
        mine = rows[rank * self.prompts_per_step : (rank + 1) * self.prompts_per_step]
        prompts = collate_prompts([self.train_set[i] for i in mine])
        if self.max_staleness:  # the worker owns the training explorer and its generator: it rolls out, now
            ahead = self.ensure_ahead()
            batch = ahead.run_now(
                self._generation(prompts, context.explorer, self.group_size), ahead.snapshot, context.version.value
            )
            batch.stats["async/staleness"] = 0.0
            return batch
        return self.rollout(prompts, context.explorer, self.group_size)

    def rollout(self, prompts: dict, explorer, n: int) -> RolloutBatch:
        """Roll out a collated prompt batch ``n`` times each and attach gold answers and ids."""
        return self._generation(prompts, explorer, n)(self.ensure_engine())

    def _generation(self, prompts: dict, explorer, n: int) -> Callable[[RolloutEngine], RolloutBatch]:
        """The rollout of a collated prompt batch (``n`` samples each, gold answers and ids) by a given engine."""

        def generate(engine: RolloutEngine) -> RolloutBatch:
            out = engine.generate(prompts["prompt_ids"], explorer, n=n, max_new_tokens=self.max_new_tokens)
            out.answers = [a for a in prompts["answer"] for _ in range(n)]
            out.verifiers = [v for v in prompts.get("verifier", [None] * len(prompts["answer"])) for _ in range(n)]
            out.problem_ids = [i for i in prompts["id"] for _ in range(n)]
            return out

        return generate

    def sync_engine(self) -> None:
        """Give an engine with its own weights (vLLM) the policy's current weights if the version moved."""
        self.ensure_engine()

    def teardown(self, stage: str | None = None) -> None:
        """Stop the rollout worker with ``fit``; the engine outlives it (released by :meth:`close`)."""
        if stage == "fit":
            self.close_ahead()

    def close(self) -> None:
        """Release the rollout engine (vLLM's memory and threads)."""
        self.close_ahead()
        self.engines.close()

    # ------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        """Seed, data positions and the engine's sampling RNG (every rank's); with ``max_staleness`` the rollouts in
        flight (waited for) and the worker engine's RNG, so a resumed run trains on them."""
        position = self.stream.state_dict() if self.stream is not None else self._position
        # the worker first: it waits for the rollouts in flight, after which a shared engine is idle
        ahead = self.ahead.state_dict() if self.ahead is not None else self._ahead_state
        if self.max_staleness:
            ahead = by_rank(ahead, self._rank()[1])  # each rank's rollouts in flight
        return {
            "seed": self.seed,
            "extra_prompts_drawn": self.extra_prompts_drawn,
            **(position or {"epoch": 0, "batches_in_epoch": 0}),
            "engine": self.engines.state_dict(),
            "world_size": self._rank()[1],
            "ahead": ahead,
        }

    def load_state_dict(self, state: dict) -> None:
        self.seed = state.get("seed", self.seed)
        self.extra_prompts_drawn = state.get("extra_prompts_drawn", 0)
        if "epoch" in state:
            self._position = {"epoch": int(state["epoch"]), "batches_in_epoch": int(state["batches_in_epoch"])}
            if self.stream is not None:
                self.stream.load_state_dict(self._position)
                self._position = None
        saved_world, world = state.get("world_size", 1), self._rank()[1]
        if saved_world != world:
            raise ValueError(
                f"the checkpoint was made by {saved_world} process(es), this run has {world}: "
                "resume with the same trainer (number of devices)"
            )
        ahead = state.get("ahead") if self.max_staleness else None
        if isinstance(ahead, list):  # by rank (else one process's state)
            ahead = ahead[self._rank()[0]]
        self._ahead_state = ahead
        if self.ahead is not None and self._ahead_state is not None:
            self.ahead.load_state_dict(self._ahead_state)
            self._ahead_state = None
        self.engines.load_state_dict(state.get("engine") or [None])
