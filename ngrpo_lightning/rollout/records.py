"""Sparse records of the non-discrete decoding steps of a rollout.

One record per non-discrete step: its row, response position, and the mixture ``sum_j weights[j] * E[ids[j]] +
noise_scale * randn(d, seed=noise_seed)`` that replaced ``E[token]`` as that position's input embedding. Discrete
steps cost nothing; noise is regenerated from its seed, never stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ngrpo_lightning.rollout.padding import pad_to

NO_NOISE = -1  # noise_seed of records without additive noise
NOISE_GENERATOR = "hash32-box-muller"  # how noise is made from a seed (noise_vectors), saved in checkpoints
RECORD_FIELDS = ("pos", "ids", "weights", "noise_seed", "noise_scale")  # a record's fields besides its row


@dataclass
class InputRecords:
    """M records for a batch. ``pos`` is the *response* index of the emitted token whose input embedding was
    replaced; ``ids``/``weights`` are padded to the largest K with weight 0."""

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
        """The records of one decoding step's ``mixed`` rows (an :class:`ExplorerStep`) at response position ``pos``."""
        return cls.from_steps([(pos, step, mixed)])

    @classmethod
    def from_steps(cls, steps: list) -> InputRecords:
        """The records of a rollout's decoding steps, kept dense until now: ``(pos, step, mixed)`` per step, each
        :class:`ExplorerStep` and ``mixed`` mask over the same R rows (:meth:`from_dense` of them stacked)."""
        if not steps:
            return cls()
        k = max(s.ids.shape[1] for _, s, _ in steps)
        rows, device = steps[0][2].shape[0], steps[0][2].device

        def stacked(field: str, fill, dtype) -> torch.Tensor | None:
            parts = [getattr(s, field) for _, s, _ in steps]
            if all(p is None for p in parts):
                return None
            fills = [torch.full((rows,), fill, dtype=dtype, device=device) if p is None else p.to(dtype) for p in parts]
            return torch.stack(fills)

        return cls.from_dense(
            torch.stack([m for _, _, m in steps]),
            torch.stack([pad_to(s.ids, k, 0) for _, s, _ in steps]),
            torch.stack([pad_to(s.weights.float(), k, 0.0) for _, s, _ in steps]),
            stacked("noise_seed", NO_NOISE, torch.long),
            stacked("noise_scale", 0.0, torch.float32),
            pos=torch.tensor([p for p, _, _ in steps], dtype=torch.long, device=device),
        )

    @classmethod
    def from_dense(cls, mixed, ids, weights, noise_seed=None, noise_scale=None, pos=None) -> InputRecords:
        """The records of the ``mixed`` entries of steps kept dense: ``mixed`` [S, R], ``ids`` and ``weights`` [S, R,
        K], ``noise_seed`` and ``noise_scale`` [S, R] (None: no noise), ``pos`` [S] the steps' response positions
        (None: 0..S-1). Step-major, then row."""
        at, row = mixed.nonzero().unbind(1)
        return cls(
            row=row,
            pos=at if pos is None else pos[at],
            ids=ids[at, row],
            weights=weights[at, row],
            noise_seed=torch.full_like(row, NO_NOISE) if noise_seed is None else noise_seed[at, row],
            noise_scale=torch.zeros(len(row), device=row.device) if noise_scale is None else noise_scale[at, row],
        )

    def has_noise(self) -> bool:
        """Whether any record adds noise (rebuilt from its seed by :func:`noise_vectors`)."""
        return bool((self.noise_seed != NO_NOISE).any())

    def select_rows(self, rows: torch.Tensor) -> InputRecords:
        """Records of a subset of batch rows, renumbered to the subset's order."""
        match = self.row[:, None] == rows.to(self.row.device)[None, :]  # [M, R]
        at = match.any(1).nonzero().squeeze(1)  # one wait for the device; a boolean index per field was one each
        return replace(self.take(at), row=match.index_select(0, at).long().argmax(1))

    def take(self, at: torch.Tensor) -> InputRecords:
        """The records at indices ``at`` (long, [M']), in that order."""
        return InputRecords(**{k: v.index_select(0, at) for k, v in vars(self).items()})

    def to(self, device) -> InputRecords:
        return InputRecords(**{k: v.to(device) for k, v in vars(self).items()})


def rebuilds_as_saved(noise_seed: torch.Tensor, generator: str | None) -> bool:
    """Whether records saved under noise ``generator`` (None: unnamed) rebuild the noise their rollout saw."""
    return generator == NOISE_GENERATOR or not bool((noise_seed != NO_NOISE).any())


MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``x < 2**32``, in 16-bit halves of ``c`` so that no int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash ("lowbias32" xor-shift-multiply), on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


class ComponentHashes:
    """``_hash32(arange(count))`` made once per width and device and kept by the decoding loop: the half of every
    noise vector's bits that depends on the component alone."""

    def __init__(self):
        self.kept: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, count: int, device: torch.device) -> torch.Tensor:
        key = (count, torch.device(device))
        if key not in self.kept:
            with torch.inference_mode(False):  # made inside a rollout's no-grad code, read anywhere after
                self.kept[key] = _hash32(torch.arange(count, device=device))
        return self.kept[key]


def noise_vectors(seeds: torch.Tensor, dim: int, hashes: ComponentHashes | None = None) -> torch.Tensor:
    """Standard normal vectors [M, dim] (float32), one per seed, computed on the seeds' device. Counter-based: every
    component is a function of (seed, component), pairs of 32-bit hashes turned into normals by Box-Muller (float64),
    so a rollout makes its noise without a host round trip and training rebuilds it from the recorded seeds (exact in
    the integer part, to float32 rounding across devices). ``hashes``: kept component hashes (a decoding loop's)."""
    seeds = seeds.long()
    lo, hi = seeds & MASK32, (seeds >> 32) & MASK32
    key = _hash32(lo ^ _hash32(hi ^ 0x9E3779B9))[:, None]
    pairs = (dim + 1) // 2  # a pair of uniforms gives a pair of normals
    if hashes is None:
        components = _hash32(torch.arange(2 * pairs, device=seeds.device))
    else:
        components = hashes(2 * pairs, seeds.device)
    bits = _hash32(key ^ components[None])  # [M, 2 pairs]
    radius = torch.sqrt(-2.0 * torch.log((bits[:, 0::2].double() + 1.0) / 2.0**32))  # u in (0, 1]: a finite log
    angle = (2.0 * math.pi / 2.0**32) * bits[:, 1::2].double()
    return torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], -1).flatten(1)[:, :dim].float()
