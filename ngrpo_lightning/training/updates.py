"""A training step's rollouts, and the hook through which callbacks shape them.

:class:`StepRollouts` is what a step trains on: the rollout batch, its rewards and, once prepared, advantages, old
(proximal) and reference log-probs, row-aligned; *replayed* rows carry their stored behaviour log-probs.
:class:`StepHook` is what a callback implements to take part in a step, given as ``RLModule(step_hooks=[...])``; the
module calls each in order and goes on with what it returns:

1. ``mix_in(step)``: add or substitute stored trajectories, before advantages are computed;
2. ``weigh(step)``: change the prepared step before its updates (e.g. importance-weight replayed rows); then
   :mod:`ngrpo_lightning.training.planning` splits it into updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.rollout.padding import pad_to

__all__ = ["StepHook", "StepRollouts"]

_PER_TOKEN = ("behaviour_logp", "old_logp", "ref_logp")
_PER_ROW = ("rewards", "replayed", "advantages")


@dataclass
class StepRollouts:
    """N rollouts of one training step (rows grouped by prompt, as in the batch)."""

    batch: RolloutBatch
    rewards: torch.Tensor  # [N] float
    replayed: torch.Tensor  # [N] bool: rows replayed from earlier steps
    behaviour_logp: torch.Tensor  # [N, L]: log-probs of the policy that sampled each replayed row (0 for fresh rows)
    advantages: torch.Tensor | None = None  # [N], set by the module
    old_logp: torch.Tensor | None = (
        None  # [N, L] proximal policy (the policy at the start of the step), set by the module
    )
    ref_logp: torch.Tensor | None = None  # [N, L] reference policy, when a KL term is used
    pad_id: int = 0  # token id used to pad when rows of different widths are joined
    stats: dict[str, float] = field(default_factory=dict)  # counts to log (replay/*, dynamic/*)

    @classmethod
    def fresh(cls, batch: RolloutBatch, rewards: torch.Tensor, pad_id: int = 0) -> StepRollouts:
        """Rollouts of the current policy: nothing replayed."""
        n = len(batch)
        device = batch.response_ids.device
        return cls(
            batch,
            rewards.to(device),
            torch.zeros(n, dtype=torch.bool, device=device),
            torch.zeros_like(batch.rollout_logprobs),
            pad_id=pad_id,
        )

    def __len__(self) -> int:
        return len(self.batch)

    @property
    def group_size(self) -> int:
        return self.batch.group_size

    @property
    def num_groups(self) -> int:
        return len(self) // self.group_size

    def select(self, rows: torch.Tensor | list[int]) -> StepRollouts:
        """The given rows (in that order), every row- and token-aligned tensor with them."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        out = {
            name: None if getattr(self, name) is None else getattr(self, name)[rows.to(getattr(self, name).device)]
            for name in _PER_ROW + _PER_TOKEN
        }
        return replace(self, batch=self.batch.select(rows), stats=dict(self.stats), **out)

    def select_groups(self, groups: torch.Tensor | list[int]) -> StepRollouts:
        """Whole groups, by group index."""
        groups = torch.as_tensor(groups, dtype=torch.long)
        g = self.group_size
        return self.select((groups[:, None] * g + torch.arange(g)[None, :]).reshape(-1))

    @classmethod
    def concat(cls, parts: list[StepRollouts]) -> StepRollouts:
        """Rows of several steps' rollouts, in order (responses re-padded to the widest)."""
        if len(parts) == 1:
            return parts[0]
        batch = RolloutBatch.concat([p.batch for p in parts], pad_id=parts[0].pad_id)
        width = batch.response_ids.shape[1]
        out = {}
        for name in _PER_ROW + _PER_TOKEN:
            values = [getattr(p, name) for p in parts]
            if any(v is None for v in values):
                out[name] = None
            else:
                out[name] = torch.cat([pad_to(v, width) if name in _PER_TOKEN else v for v in values])
        return replace(parts[0], batch=batch, stats=dict(parts[0].stats), **out)


class StepHook:
    """Takes part in every training step; implemented by callbacks. The defaults change nothing."""

    def mix_in(self, step: StepRollouts) -> StepRollouts:
        """Add stored trajectories to freshly scored rollouts (before advantages exist)."""
        return step

    def weigh(self, step: StepRollouts) -> StepRollouts:
        """Change a prepared step (advantages, old and reference log-probs are set) before its updates."""
        return step
