"""Plain sampling: the GRPO baseline. Every step is discrete."""

from __future__ import annotations

import torch

from ngrpo_lightning.explorers.base import Explorer, ExplorerStep, check_range, register_explorer
from ngrpo_lightning.explorers.sampling import filter_logits, sample_tokens


@register_explorer("temperature")
class TemperatureExplorer(Explorer):
    """Sample ``y ~ softmax(filter(z / T))`` and feed ``E[y]``.

    Args:
        temperature: T; 0 means greedy decoding.
        top_k: keep the k most likely tokens (0 = off).
        top_p: nucleus sampling mass (1.0 = off).
        min_p: drop tokens below ``min_p * max prob`` (0 = off).
    """

    sync_free = True
    capturable = True  # recorded with the model's step on a GPU (rollout/step_graphs.py)

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
        check_range("temperature", temperature, 0.0)
        check_range("top_k", top_k, 0, integer=True)
        check_range("top_p", top_p, 0.0, 1.0, low_open=True)
        check_range("min_p", min_p, 0.0, 1.0)
        self.temperature = float(temperature)
        self.top_k, self.top_p, self.min_p = int(top_k), float(top_p), float(min_p)

    def step(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> ExplorerStep:
        return ExplorerStep(tokens=self.sample(logits, generator))

    def sample(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The plain sampling step, reused by explorers that fall back to it."""
        return sample_tokens(logits, self.temperature, self.top_k, self.top_p, self.min_p, generator)

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """``filter(logits / T)``: the distribution the sampling draws from, in logits (T = 0 counts as 1)."""
        return filter_logits(logits.float() / (self.temperature or 1.0), self.top_k, self.top_p, self.min_p)
