"""The order of a run's training prompts: a seeded shuffle per pass, split by rank, with a
resume position (:class:`PromptSampler`), and the training DataLoader that Lightning resumes
mid-epoch (:class:`PromptLoader`). The :class:`~.datamodule.RolloutDataModule` builds both and
reads the same order to look ahead (``train.max_staleness``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Sampler

__all__ = ["PromptLoader", "PromptSampler"]


class PromptSampler(Sampler[int]):
    """Prompt order of the training set: a seeded shuffle per pass (``seed + pass``), this
    rank's share of it, and a resume position.

    Distributed runs split *prompts* by rank (every rank rolls out its prompts G times, so a
    group never spans ranks), padded like ``DistributedSampler`` so that every rank gets the
    same number of batches (rollouts under FSDP are collectives).

    The sampler counts its passes itself (``set_epoch`` is ignored): Lightning's epoch
    counter and the data's position disagree after resuming from a checkpoint written at the
    end of training (Lightning then starts a new epoch, the data continues the old pass).
    A pass starting at ``epoch`` skips its first ``skip`` prompts once (resume);
    ``on_pass(epoch, batches_skipped)`` is told where each pass starts.
    """

    def __init__(
        self,
        size: int,
        seed: int,
        shuffle: bool,
        rank: int = 0,
        world_size: int = 1,
        batch_size: int = 1,
        epoch: int = 0,
        skip: int = 0,
        on_pass: Callable[[int, int], None] | None = None,
    ):
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self.per_rank = math.ceil(size / world_size)
        if size >= batch_size * world_size:  # drop_last semantics: whole batches on every rank
            self.per_rank = (size // world_size) // batch_size * batch_size
        self.epoch, self.next_epoch, self.skip, self.on_pass = epoch, epoch, skip, on_pass

    def set_epoch(self, epoch: int) -> None:
        """Ignored: passes are counted by the sampler (see the class docstring)."""

    def order(self, epoch: int) -> list[int]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        else:
            order = list(range(self.size))
        total = self.per_rank * self.world_size
        order = (order * math.ceil(total / max(len(order), 1)))[:total] if total > len(order) else order[:total]
        return order[self.rank : total : self.world_size]

    def __iter__(self):
        while self.per_rank and self.skip >= self.per_rank:  # the saved position ended a pass
            self.skip -= self.per_rank
            self.next_epoch += 1
        self.epoch, skip = self.next_epoch, self.skip
        self.next_epoch, self.skip = self.epoch + 1, 0
        if self.on_pass is not None:
            self.on_pass(self.epoch, skip // max(self.batch_size, 1))
        return iter(self.order(self.epoch)[skip:])

    def __len__(self) -> int:
        return self.per_rank


class PromptLoader(DataLoader):
    """The training DataLoader. Its position is saved and restored by the DataModule
    (``epoch``, ``batches_in_epoch``) through the :class:`PromptSampler`; these two methods
    tell Lightning that the loader resumes mid-epoch correctly."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to do: see :meth:`RolloutDataModule.load_state_dict`."""
