"""Gaussian embedding noise: the STHT ("Soft Tokens, Hard Truths") baseline.

Emit plainly sampled ``y``; with probability ``rho`` per row feed ``E[y] + scale * n``, ``n ~ N(0, I_d)``, and

    scale = sigma * ||E[y]|| / sqrt(d)

so that ``||scale * n|| ~= sigma * ||E[y]||`` (``sigma``: the noise-to-signal ratio). The noise is isotropic,
what N-GRPO's neighbor mixing argues against. Training regenerates ``n`` from each row's recorded (seed, scale)."""

from __future__ import annotations

import math

import torch

from ngrpo_lightning.explorers.base import ExplorerStep, check_range, register_explorer
from ngrpo_lightning.explorers.temperature import TemperatureExplorer

SEED_HIGH = 2**62  # noise seeds are drawn from [0, SEED_HIGH); -1 marks "no noise" in records


def noise_seeds(n: int, generator: torch.Generator | None, device) -> torch.Tensor:
    """One noise seed per row from the rollout generator (:func:`~ngrpo_lightning.rollout.records.noise_vectors`)."""
    return torch.randint(0, SEED_HIGH, (n,), generator=generator, device=device)


@register_explorer("gaussian")
class GaussianNoiseExplorer(TemperatureExplorer):
    """Isotropic Gaussian noise on the sampled token's embedding.

    Args:
        sigma: noise norm relative to the embedding norm (0 = no noise).
        rho: probability that a row's step is noisy (1.0 = every step, as in STHT).
        temperature, top_k, top_p, min_p: the token sampling (see :class:`TemperatureExplorer`).
    """

    capturable = True  # recorded with the model's step on a GPU (rollout/step_graphs.py)

    def __init__(
        self,
        sigma: float = 0.5,
        rho: float = 1.0,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
    ):
        super().__init__(temperature, top_k, top_p, min_p)
        check_range("sigma", sigma, 0.0)
        check_range("rho", rho, 0.0, 1.0)
        self.sigma, self.rho = float(sigma), float(rho)

    def step(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> ExplorerStep:
        tokens = self.sample(logits, generator)
        if self.sigma == 0.0 or self.rho == 0.0:
            return ExplorerStep(tokens=tokens)
        b, device = tokens.shape[0], logits.device
        mixed = (
            torch.ones(b, dtype=torch.bool, device=device)
            if self.rho == 1.0
            else torch.rand(b, generator=generator, device=device) < self.rho
        )
        seeds = noise_seeds(b, generator, device)
        emb = self.embeddings[tokens.to(self.embeddings.device)].float()
        scale = (self.sigma * emb.norm(dim=-1) / math.sqrt(emb.shape[-1])).to(device)
        return ExplorerStep(
            tokens=tokens,
            mixed=mixed,
            ids=tokens[:, None],
            weights=torch.ones(b, 1, device=device),
            noise_seed=seeds,
            noise_scale=scale,
        )
