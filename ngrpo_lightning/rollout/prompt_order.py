"""The order of a run's training prompts: one stream of batches that the training DataLoader reads, rollouts ahead
peek into, and checkpoints save.

A batch is known by its key ``(pass, index)``: pass p over the training set is a shuffle seeded by ``seed + p``, cut
into this rank's share and into batches of ``prompts_per_step``. :class:`PromptStream` is the loader's batch sampler;
every batch carries its key (:func:`keyed_collate`), and :meth:`PromptStream.following` names the batches after it. A
resumed run starts at its position, the next batch to train. Validation uses :class:`RankShare` (each prompt once).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from ngrpo_lightning.data import collate_prompts

__all__ = ["Key", "PromptLoader", "PromptStream", "RankShare", "keyed_collate"]

Key = tuple[int, int]  # (pass over the training set, batch index in it)


def rank_share(order: list[int], per_rank: int, rank: int, world_size: int) -> list[int]:
    """This rank's ``per_rank`` items of ``order``, padded by repeating it so every rank gets as many (rollouts
    under FSDP are collectives)."""
    total = per_rank * world_size
    order = (order * math.ceil(total / max(len(order), 1)))[:total] if total > len(order) else order[:total]
    return order[rank:total:world_size]


class PromptStream(Sampler[list[tuple[int, Key]]]):
    """Training prompt batches in order, from a position, for one rank. Distributed runs split *prompts* by rank (a
    group never spans ranks), the same number of whole batches on every rank. Iterating yields the batches from the
    position to the end of its pass (Lightning's epoch), as lists of ``(dataset index, key)``; the position moves when
    a batch is :meth:`consumed`. The stream counts its passes itself (a resumed run's new epoch may continue a pass)."""

    def __init__(self, size: int, seed: int, shuffle: bool, batch_size: int, rank: int = 0, world_size: int = 1):
        self.size, self.seed, self.shuffle, self.batch_size = size, seed, shuffle, batch_size
        self.rank, self.world_size = rank, world_size
        per_rank = math.ceil(size / world_size)
        if size >= batch_size * world_size:  # whole batches on every rank
            per_rank = (size // world_size) // batch_size * batch_size
        self.per_rank = per_rank
        self.batches_per_pass = max(per_rank // batch_size, 1)
        self.position: Key = (0, 0)  # the next batch to yield

    def order(self, epoch: int) -> list[int]:
        """This rank's dataset indices in pass ``epoch``."""
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        else:
            order = list(range(self.size))
        return rank_share(order, self.per_rank, self.rank, self.world_size)

    def rows(self, key: Key) -> list[int]:
        """The dataset indices of batch ``key``."""
        epoch, index = key
        return self.order(epoch)[index * self.batch_size : (index + 1) * self.batch_size]

    def next_key(self, key: Key) -> Key:
        epoch, index = key
        return (epoch, index + 1) if index + 1 < self.batches_per_pass else (epoch + 1, 0)

    def following(self, key: Key, count: int) -> list[Key]:
        """The ``count`` batches after ``key``, in order."""
        out = []
        for _ in range(max(count, 0)):
            key = self.next_key(key)
            out.append(key)
        return out

    def consumed(self, key: Key) -> None:
        """Batch ``key`` was trained on: the position moves past it (the loader reads ahead: the consumer says so)."""
        self.position = self.next_key(key)

    def __iter__(self) -> Iterator[list[tuple[int, Key]]]:
        epoch, index = self.position
        if index >= self.batches_per_pass:  # a saved position at the end of a pass
            epoch, index = epoch + 1, 0
        for i in range(index, self.batches_per_pass):
            yield [(row, (epoch, i)) for row in self.rows((epoch, i))]

    def __len__(self) -> int:
        return self.batches_per_pass

    def state_dict(self) -> dict:
        return {"epoch": self.position[0], "batches_in_epoch": self.position[1]}

    def load_state_dict(self, state: dict) -> None:
        self.position = (int(state["epoch"]), int(state["batches_in_epoch"]))


class KeyedDataset(torch.utils.data.Dataset):
    """A prompt dataset read by ``(index, key)``: each item carries the key of its batch."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, item: tuple[int, Key]) -> dict:
        index, key = item
        return {**self.dataset[index], "key": key}

    def __len__(self) -> int:
        return len(self.dataset)


def keyed_collate(items: list[dict]) -> dict:
    """:func:`~ngrpo_lightning.data.collate_prompts`, plus the batch's ``key``."""
    return {**collate_prompts(items), "key": items[0]["key"]}


class PromptLoader(DataLoader):
    """The training DataLoader over a :class:`PromptStream` (whose position the DataModule saves); its state methods
    tell Lightning that it resumes mid-epoch correctly."""

    def __init__(self, dataset, stream: PromptStream):
        super().__init__(KeyedDataset(dataset), batch_sampler=stream, collate_fn=keyed_collate)
        self.stream = stream

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to do: see :meth:`RolloutDataModule.load_state_dict`."""


class RankShare(Sampler[int]):
    """Every index of a set once, in order, this rank's share (a few twice when uneven)."""

    def __init__(self, size: int, rank: int = 0, world_size: int = 1):
        self.items = rank_share(list(range(size)), math.ceil(size / world_size), rank, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)
