"""A user-written explorer: with probability rho, feed a blend of the two likeliest tokens."""

import torch

from ngrpo_lightning.explorers import Explorer, ExplorerStep, TemperatureExplorer, check_range


class TopTwoBlend(Explorer):
    """Mixed rows emit the likeliest token and feed softmax-weighted E[top1], E[top2];
    the other rows sample as plain temperature sampling does."""

    sync_free = True  # step() never makes the host wait for a GPU (no .item(), bool(t), nonzero)
    capturable = True  # the same device work at every step, randomness from generator: recorded on a GPU

    def __init__(self, rho: float = 0.2, temperature: float = 1.0):
        check_range("rho", rho, 0.0, 1.0)  # a bad value fails at build time, naming explorer.rho
        check_range("temperature", temperature, 0.0, low_open=True)
        self.rho, self.temperature = rho, temperature
        self.sampler = TemperatureExplorer(temperature)

    def step(self, logits, generator=None):
        tokens = self.sampler.sample(logits, generator)
        mixed = torch.rand(len(logits), generator=generator, device=logits.device) < self.rho
        top = (logits / self.temperature).topk(2, dim=-1)
        tokens = torch.where(mixed, top.indices[:, 0], tokens)
        return ExplorerStep(tokens=tokens, mixed=mixed, ids=top.indices, weights=top.values.softmax(-1))
