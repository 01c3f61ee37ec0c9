"""Sparse records of the non-discrete decoding steps of a rollout.

One record per non-discrete step: which row, which response position, and the
mixture ``sum_j weights[j] * E[ids[j]] + noise_scale * randn(d, seed=noise_seed)``
that replaced ``E[token]`` as the input embedding of that position. Discrete steps
(the vast majority) cost nothing. Noise is regenerated from its seed, never stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ngrpo_lightning.rollout.padding import pad_to

NO_NOISE = -1  # noise_seed of records without additive noise
RECORD_FIELDS = ("pos", "ids", "weights", "noise_seed", "noise_scale")  # a record's fields besides its row


@dataclass
class InputRecords:
    """M records for a batch. ``pos`` is the *response* index of the emitted token whose
    input embedding was replaced; ``ids``/``weights`` are padded to the largest K with
    weight 0."""

    row: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [M]
    pos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [M]
    ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 1, dtype=torch.long))  # [M, K]
    weights: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 1))  # [M, K]
    noise_seed: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [M]
    noise_scale: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [M]

    def __len__(self) -> int:
        return int(self.row.numel())

    @classmethod
    def concat(cls, parts: list[InputRecords]) -> InputRecords:
        """Concatenate records (of the same batch), padding K to the largest."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls()
        k = max(p.ids.shape[1] for p in parts)
        return cls(
            row=torch.cat([p.row for p in parts]),
            pos=torch.cat([p.pos for p in parts]),
            ids=torch.cat([pad_to(p.ids, k, 0) for p in parts]),
            weights=torch.cat([pad_to(p.weights, k, 0.0) for p in parts]),
            noise_seed=torch.cat([p.noise_seed for p in parts]),
            noise_scale=torch.cat([p.noise_scale for p in parts]),
        )

    @classmethod
    def from_step(cls, step, mixed: torch.Tensor, pos: int) -> InputRecords:
        """The records of one decoding step's ``mixed`` rows (an :class:`ExplorerStep`), at
        response position ``pos``."""
        rows = mixed.nonzero().squeeze(-1)
        m = rows.numel()
        seed = (
            step.noise_seed[rows]
            if step.noise_seed is not None
            else torch.full((m,), NO_NOISE, dtype=torch.long, device=rows.device)
        )
        scale = step.noise_scale[rows].float() if step.noise_scale is not None else torch.zeros(m, device=rows.device)
        return cls(
            row=rows,
            pos=torch.full((m,), pos, dtype=torch.long, device=rows.device),
            ids=step.ids[rows],
            weights=step.weights[rows].float(),
            noise_seed=seed,
            noise_scale=scale,
        )

    def select_rows(self, rows: torch.Tensor) -> InputRecords:
        """Records of a subset of batch rows, renumbered to the subset's order."""
        match = self.row[:, None] == rows.to(self.row.device)[None, :]  # [M, R]
        keep = match.any(1)
        return InputRecords(
            row=match[keep].long().argmax(1),
            pos=self.pos[keep],
            ids=self.ids[keep],
            weights=self.weights[keep],
            noise_seed=self.noise_seed[keep],
            noise_scale=self.noise_scale[keep],
        )

    def to(self, device) -> InputRecords:
        return InputRecords(**{k: v.to(device) for k, v in vars(self).items()})


def noise_vectors(seeds: torch.Tensor, dim: int) -> torch.Tensor:
    """Standard normal vectors [M, dim], one per seed, identical on every device and engine.

    Generated on CPU in float32 from ``torch.Generator().manual_seed(seed)`` so that rollout
    and training (and different engines) draw the same noise."""
    out = torch.empty(len(seeds), dim)
    gen = torch.Generator()
    for i, s in enumerate(seeds.tolist()):
        gen.manual_seed(int(s))
        out[i] = torch.randn(dim, generator=gen)
    return out
