"""RolloutDataModule: a LightningDataModule whose batches are rollouts of the current policy.

The dataloaders yield batches of tokenized prompts; ``on_after_batch_transfer`` (a
DataModule hook Lightning calls on every batch, after moving it to the device) turns each
into a :class:`RolloutBatch` by rolling out the *current* policy with the configured
engine: the training explorer and G samples per prompt in training, plain sampling and
``val_samples`` per prompt in validation.

:meth:`RolloutDataModule.more_rollouts` rolls out one more training prompt batch on
demand, outside the dataloader: the module's dynamic sampling (DAPO) calls it to refill
a batch that lost its zero-variance groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader

from .batch import RolloutBatch
from .engine import RolloutEngine

ENGINES = ("hf", "vllm")


def build_engine(name: str, module: L.LightningModule, max_new_tokens: int, seed: int, **kwargs) -> RolloutEngine:
    """The rollout engine ``rollout.engine=<name>`` for the module's policy."""
    if name == "hf":
        from .hf_engine import HFEngine

        return HFEngine(module.policy, module.tokenizer, max_new_tokens=max_new_tokens, seed=seed)
    if name == "vllm":
        from .vllm_engine import VLLMEngine  # noqa: F401  (optional dependency)

        return VLLMEngine.for_module(module, max_new_tokens=max_new_tokens, seed=seed, **kwargs)
    raise ValueError(f"rollout.engine={name!r} is unknown: allowed {list(ENGINES)}")


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
        engine: ``hf`` (default) or ``vllm``.
        instruction / system_prompt: prompt rendering (see :mod:`ngrpo_lightning.data.prompts`).
        seed: shuffling and sampling seed.
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
        instruction: str | None = None,
        system_prompt: str | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ):
        super().__init__()
        if engine not in ENGINES:
            raise ValueError(f"rollout.engine={engine!r} is unknown: allowed {list(ENGINES)}")
        if group_size < 1 or prompts_per_step < 1:
            raise ValueError(f"rollout.group_size ({group_size}) and data.prompts_per_step ({prompts_per_step}) must be >= 1")
        self.tokenizer = tokenizer
        self.train_problems, self.val_problems = list(train_problems), list(val_problems)
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.max_new_tokens, self.max_prompt_tokens = max_new_tokens, max_prompt_tokens
        self.val_samples, self.val_batch_size = val_samples, val_batch_size
        self.engine_name, self.engine_kwargs = engine, engine_kwargs or {}
        self.prompt_kwargs = {k: v for k, v in {"instruction": instruction, "system_prompt": system_prompt}.items() if v is not None}
        self.seed, self.shuffle = seed, shuffle
        self.engine: RolloutEngine | None = None
        self.train_set = self.val_set = None
        self.extra_prompts_drawn = 0  # position in the stream of more_rollouts()

    # ------------------------------------------------------------- datasets
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set = self._dataset(self.train_problems)
            self.val_set = self._dataset(self.val_problems) if self.val_problems else None

    def _dataset(self, problems):
        from ..data import PromptDataset

        return PromptDataset(problems, self.tokenizer, max_prompt_tokens=self.max_prompt_tokens, **self.prompt_kwargs)

    def train_dataloader(self) -> DataLoader:
        from ..data import collate_prompts

        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.prompts_per_step, shuffle=self.shuffle, generator=gen,
                          drop_last=len(self.train_set) >= self.prompts_per_step, collate_fn=collate_prompts)

    def val_dataloader(self) -> DataLoader:
        from ..data import collate_prompts

        if self.val_set is None or len(self.val_set) == 0:
            return []
        return DataLoader(self.val_set, batch_size=self.val_batch_size, shuffle=False, collate_fn=collate_prompts)

    # ------------------------------------------------------------- rollouts
    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if isinstance(batch, RolloutBatch):
            return batch
        module = self._module_with_engine()
        if self.trainer.training:
            return self.rollout(batch, module.explorer, self.group_size)
        return self.rollout(batch, module.eval_explorer, self.val_samples)

    def _module_with_engine(self) -> L.LightningModule:
        module = self.trainer.lightning_module
        if self.engine is None:
            self.engine = build_engine(self.engine_name, module, self.max_new_tokens, self.seed, **self.engine_kwargs)
        return module

    def more_rollouts(self) -> RolloutBatch:
        """Roll out one more batch of ``prompts_per_step`` training prompts with the training
        explorer (``group_size`` samples each), outside the dataloader.

        Prompts come from a second stream over the training set: seeded shuffles, one per
        pass, independent of the dataloader's order. Its position (``extra_prompts_drawn``)
        is saved in checkpoints, so a resumed run draws the same prompts.
        """
        from ..data import collate_prompts

        module = self._module_with_engine()
        self.setup("fit")
        size, count = len(self.train_set), self.prompts_per_step
        rows: list[int] = []
        while len(rows) < count:
            shuffle, start = divmod(self.extra_prompts_drawn, size)
            order = torch.randperm(size, generator=torch.Generator().manual_seed(self.seed + 7919 * (shuffle + 1)))
            take = order[start:start + count - len(rows)].tolist()
            rows += take
            self.extra_prompts_drawn += len(take)
        return self.rollout(collate_prompts([self.train_set[i] for i in rows]), module.explorer, self.group_size)

    def rollout(self, prompts: dict, explorer, n: int) -> RolloutBatch:
        """Roll out a collated prompt batch ``n`` times each and attach gold answers and ids."""
        out = self.engine.generate(prompts["prompt_ids"], explorer, n=n, max_new_tokens=self.max_new_tokens)
        out.answers = [a for a in prompts["answer"] for _ in range(n)]
        out.problem_ids = [i for i in prompts["id"] for _ in range(n)]
        return out

    def teardown(self, stage: str | None = None) -> None:
        if self.engine is not None and stage in (None, "fit"):
            self.engine.close()

    # ------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        return {"seed": self.seed, "extra_prompts_drawn": self.extra_prompts_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.seed = state.get("seed", self.seed)
        self.extra_prompts_drawn = state.get("extra_prompts_drawn", 0)

