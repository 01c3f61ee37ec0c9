"""Gumbel soft thinking: the SofT-GRPO-style baseline. Every step is a soft token.

With ``z~ = logits / T``, its top-k entries ``z~_k`` (ids ``ids_k``) and iid noise ``g ~ Gumbel(0, 1)``, set

    weights = softmax((z~_k + g) / tau),   next input = sum_j weights_j E[ids_k_j],
    emitted token = ids_k[argmax(z~_k + g)].

By the Gumbel-max trick the emitted token exactly samples ``softmax(z~)`` in the top k; ``tau`` only shapes the mix."""

from __future__ import annotations

import torch

from ngrpo_lightning.explorers.base import Explorer, ExplorerStep, check_range, register_explorer


@register_explorer("gumbel")
class GumbelSoftExplorer(Explorer):
    """Gumbel-softmax mixture of the top-k tokens' embeddings.

    Args:
        top_k: number of tokens in each mixture (1 = greedy decoding).
        tau: Gumbel-softmax temperature of the mixture weights (> 0).
        temperature: T of the logits before the top-k and the noise (> 0).
    """

    sync_free = True
    capturable = True  # recorded with the model's step on a GPU (rollout/step_graphs.py)

    def __init__(self, top_k: int = 5, tau: float = 0.5, temperature: float = 1.0):
        check_range("top_k", top_k, 1, integer=True)
        check_range("tau", tau, 0.0, low_open=True)
        check_range("temperature", temperature, 0.0, low_open=True)
        self.top_k, self.tau, self.temperature = int(top_k), float(tau), float(temperature)

    def prepare(self, embeddings: torch.Tensor) -> None:
        super().prepare(embeddings)
        check_range("top_k", self.top_k, 1, embeddings.shape[0])

    def step(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> ExplorerStep:
        vals, ids = (logits.float() / self.temperature).topk(self.top_k, dim=-1)
        u = torch.rand(vals.shape, generator=generator, device=logits.device)
        gumbel = -torch.log(-torch.log(u.clamp_(min=torch.finfo(u.dtype).tiny)))
        perturbed = vals + gumbel
        tokens = ids.gather(-1, perturbed.argmax(-1, keepdim=True)).squeeze(-1)
        mixed = torch.ones_like(tokens, dtype=torch.bool)
        return ExplorerStep(tokens=tokens, mixed=mixed, ids=ids, weights=(perturbed / self.tau).softmax(-1))
