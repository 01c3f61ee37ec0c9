"""How one step's rollouts become optimizer updates, each computed in micro-batches.

Two planners, composed by the module in every training step::

    step = DynamicSampling.fill(step, more)   # train.dynamic_sampling: refill zero-variance groups
    ...advantages, old and reference log-probs...
    for update in UpdatePlan.updates(step):   # train.ppo_epochs x train.num_mini_batches
        for rows, weight in UpdatePlan.micro_batches(update.batch, ...):   # optim.micro_batch_size
            backward(loss(rows) * weight)
        optimizer step                        # replay hooks in too (training.updates.StepHook)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ngrpo_lightning.objectives import zero_variance_groups
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.training.settings import OptimConfig, TrainConfig
from ngrpo_lightning.training.updates import StepRollouts

__all__ = ["DynamicSampling", "UpdatePlan"]


class UpdatePlan:
    """``ppo_epochs x num_mini_batches`` optimizer updates per step, and the micro-batches of each.

    Each epoch shuffles the rows (seeded) into ``num_mini_batches`` mini-batches. Each update runs in micro-batches
    whose weighted gradients add up to the update's: at most ``micro_batch_size`` rows and, with
    ``max_tokens_per_micro_batch``, rows grouped by length within the token budget. Several processes (FSDP2): every
    rank must run as many micro-batches (each pass has collectives). ``agree`` (the most over ranks) makes a rank with
    fewer split its largest ones, or run a row again with weight 0; ``rank_share`` scales each rank's shares so the
    gradient is the global batch's token (or row) mean, whatever each rank holds.
    """

    agree: Callable[[int], int] | None = None  # micro-batch count -> the most over ranks (several processes)
    rank_share: Callable[[float], float] | None = None  # count -> count x ranks / all ranks' count

    def __init__(
        self,
        ppo_epochs: int = TrainConfig.ppo_epochs,
        num_mini_batches: int = TrainConfig.num_mini_batches,
        micro_batch_size: int = OptimConfig.micro_batch_size,
        max_tokens_per_micro_batch: int | None = OptimConfig.max_tokens_per_micro_batch,
        seed: int = 0,
    ):
        # the settings' own checks, naming train.* and optim.* keys: the rules live there once
        TrainConfig(ppo_epochs=ppo_epochs, num_mini_batches=num_mini_batches)
        OptimConfig(micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        self.ppo_epochs, self.num_mini_batches = ppo_epochs, num_mini_batches
        self.micro_batch_size, self.max_tokens = micro_batch_size, max_tokens_per_micro_batch
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def from_settings(cls, train: TrainConfig, optim: OptimConfig, seed: int = 0) -> UpdatePlan:
        """The plan of ``train.*`` and ``optim.*``."""
        return cls(
            train.ppo_epochs, train.num_mini_batches, optim.micro_batch_size, optim.max_tokens_per_micro_batch, seed
        )

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per rollout batch (``trainer.max_steps`` counts these)."""
        return self.ppo_epochs * self.num_mini_batches

    @property
    def single(self) -> bool:
        """One update per step: the update's own forward can serve as the old log-probs."""
        return self.updates_per_step == 1

    def updates(self, step: StepRollouts) -> list[StepRollouts]:
        """The step's updates, in order (each a row subset of the prepared step)."""
        n = len(step)
        splits = min(self.num_mini_batches, n)
        if self.ppo_epochs == 1 and splits == 1:
            return [step]
        updates = []
        for _ in range(self.ppo_epochs):
            order = torch.randperm(n, generator=self.generator) if splits > 1 else torch.arange(n)
            updates += [step.select(rows.sort().values) for rows in order.tensor_split(splits)]
        return updates

    def micro_batches(self, batch: RolloutBatch, token_level: bool) -> Iterator[tuple[torch.Tensor, float]]:
        """Yield ``(rows, weight)``, weight the micro-batch's share of the batch's response tokens (``token_level``)
        or rows, so the micro-batch gradients add up to the batch's."""
        n = len(batch)
        groups = self._row_groups(batch)
        pads = 0
        if self.agree is not None:
            groups, pads = _to_count(groups, self.agree(len(groups)))
        if not groups:
            return
        if not token_level:
            shares = torch.tensor([len(rows) / n for rows in groups]).tolist()  # rounded as a tensor
        else:  # every micro-batch's share in one read of the device, before the first pass is queued
            tokens = batch.response_mask.sum().clamp(min=1)
            mask = batch.response_mask
            shares = torch.stack([mask[rows.to(mask.device)].sum() / tokens for rows in groups]).tolist()
        if self.rank_share is not None:  # several processes: this rank's part of the global batch
            scale = self.rank_share(float(tokens) if token_level else float(n))
            shares = [share * scale for share in shares]
        yield from zip(groups, shares)
        for _ in range(pads):  # this rank's rows ran out: a row again, adding nothing to the gradient
            yield groups[0][:1], 0.0

    def _row_groups(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """Each micro-batch's rows: in order, ``micro_batch_size`` at a time, or with a token budget longest first."""
        n = len(batch)
        size = self.micro_batch_size or n
        if self.max_tokens is None:
            return [torch.arange(start, min(start + size, n)) for start in range(0, n, size)]
        lengths = (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).tolist()
        groups, current, longest = [], [], 0
        for row in sorted(range(n), key=lambda r: -lengths[r]):
            # padded cost of the micro-batch with this row: rows x its longest (the first, sorted)
            if current and (len(current) >= size or (len(current) + 1) * max(longest, lengths[row]) > self.max_tokens):
                groups.append(torch.tensor(sorted(current)))
                current, longest = [], 0
            current.append(row)
            longest = max(longest, lengths[row])
        if current:
            groups.append(torch.tensor(sorted(current)))
        return groups

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state:
            self.generator.set_state(state["generator"])


def _to_count(groups: list[torch.Tensor], count: int) -> tuple[list[torch.Tensor], int]:
    """``groups`` split into ``count`` micro-batches where rows allow (the largest halved first, each within the
    size and token budget its whole kept), and how many passes are still missing."""
    groups = list(groups)
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]), default=None)
        if largest is None or len(groups[largest]) < 2:
            break
        rows = groups.pop(largest)
        groups[largest:largest] = list(rows.tensor_split(2))
    return groups, count - len(groups)


class DynamicSampling:
    """DAPO's dynamic sampling: groups whose rewards are all equal carry no signal and are dropped
    (``drop="all_correct"``: only all-correct ones, as NGRPO does); the step is refilled from at most
    ``max_extra_rollouts`` extra prompt batches, surplus discarded. If nothing informative is found, the step trains
    on its original batch. Several processes: every rank rolls out as many extra batches as the neediest (``agree``)."""

    def __init__(self, max_extra_rollouts: int = TrainConfig.max_extra_rollouts, drop: str = TrainConfig.drop_groups):
        TrainConfig(max_extra_rollouts=max_extra_rollouts, drop_groups=drop)  # checks both, naming their keys
        self.max_extra_rollouts, self.drop = max_extra_rollouts, drop

    @classmethod
    def from_settings(cls, train: TrainConfig) -> DynamicSampling:
        """Dynamic sampling as ``train.*`` sets it (whether it is on is ``train.dynamic_sampling``)."""
        return cls(train.max_extra_rollouts, train.drop_groups)

    def uninformative(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """[num_groups] bool: the groups to drop."""
        if self.drop == "all_correct":
            return (rewards.view(-1, group_size) >= 1.0).all(-1)
        return zero_variance_groups(rewards, group_size)

    def fill(
        self, step: StepRollouts, more: Callable[[], StepRollouts], agree: Callable[[int], int] | None = None
    ) -> StepRollouts:
        """The step with its zero-variance groups replaced; ``more()`` rolls out and scores one more prompt batch;
        ``agree`` gives the most over ranks. Counts go to ``stats`` as ``dynamic/*``."""
        target, kept, dropped, extra, piece = step.num_groups, [], 0, 0, step
        while True:
            informative = ~self.uninformative(piece.rewards, piece.group_size)
            dropped += int((~informative).sum())
            if informative.any():
                kept.append(piece.select_groups(informative.nonzero().squeeze(-1).cpu()))
            short = sum(k.num_groups for k in kept) < target
            if agree is not None:  # every rank rolls out while any rank is short
                short = agree(int(short)) > 0
            if not short or extra >= self.max_extra_rollouts:
                break
            piece = more()
            extra += 1
        if kept:
            joined = StepRollouts.concat(kept)
            filled = joined.select_groups(torch.arange(min(target, joined.num_groups)))
        else:
            filled = step
        filled.stats = {
            **step.stats,
            "dynamic/dropped_groups": dropped,
            "dynamic/extra_rollouts": extra,
            "dynamic/kept_groups": filled.num_groups if kept else 0,
        }
        return filled
