"""The N-GRPO release's baselines (``ZJUSCL/N-GRPO``, its ``mix_strategy`` values), as explorers.

All three emit the token the sampler drew (as the release does) and, on a gated step
(Bernoulli(``rho``) per row and step, the release's ``mix_rate``), feed a mixture of the
``k`` likeliest tokens instead of its embedding. With ``z~`` the warped logits of the
sampling (temperature, top-k, top-p) and ``tau`` the mixture temperature (``mix_temperature``):

* ``topk``: the set is ``topk(z~ / tau, k)``, weighted ``softmax(z~[set] / tau)``.
* ``topk_gumbel``: the set is ``topk(z~ / tau + g, k)`` with Gumbel noise ``g`` (from the
  rollout generator); the weights are the same softmax, without the noise.
* ``gaussian_embed_noise``: the ``topk`` mixture plus Gaussian noise of standard deviation
  ``noise_rms_scale x RMS(mixture)`` per element (RMS over the hidden dimension).

Unlike the release, the noise is drawn from a recorded seed, so training rebuilds the exact
input the rollout saw (the release records no noise); and the mixture uses the input
embedding matrix ``E`` (its SGLang path takes the output matrix's rows for this baseline).
"""

from __future__ import annotations

import torch

from .base import ExplorerStep, check_answer_start, check_range, register_explorer
from .gaussian import SEED_HIGH
from .sampling import filter_logits
from .temperature import TemperatureExplorer


@register_explorer("topk")
class TopKMixExplorer(TemperatureExplorer):
    """The release's ``topk`` strategy (see the module docstring).

    Args:
        k: tokens in each mixture; rho: probability a row's step is mixed;
        mix_temperature: tau; answer_start: no mixing after this marker (release: ``"</think>"``);
        temperature, top_k, top_p, min_p: the sampling.
    """

    gumbel = False

    def __init__(
        self,
        k: int = 3,
        rho: float = 0.1,
        mix_temperature: float = 1.0,
        answer_start: str | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
    ):
        super().__init__(temperature, top_k, top_p, min_p)
        self.answer_start = check_answer_start(answer_start)
        self.k = int(check_range("k", k, 1))
        self.rho = float(check_range("rho", rho, 0.0, 1.0))
        self.mix_temperature = float(check_range("mix_temperature", mix_temperature, 0.0, low_open=True))

    def step(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> ExplorerStep:
        mixed = torch.rand(logits.shape[0], generator=generator, device=logits.device) < self.rho
        tokens = self.sample(logits, generator)
        scores = filter_logits(logits.float() / (self.temperature or 1.0), self.top_k, self.top_p, self.min_p)
        scores = scores / self.mix_temperature
        select = scores
        if self.gumbel:
            u = torch.rand(scores.shape, generator=generator, device=scores.device).clamp_(1e-6, 1 - 1e-6)
            select = scores - torch.log(-torch.log(u))
        ids = select.topk(self.k, dim=-1).indices
        return ExplorerStep(tokens=tokens, mixed=mixed, ids=ids, weights=scores.gather(-1, ids).softmax(-1))


@register_explorer("topk_gumbel")
class TopKGumbelMixExplorer(TopKMixExplorer):
    """The release's ``topk-gumbel`` strategy: Gumbel noise chooses the set, not the weights."""

    gumbel = True


@register_explorer("gaussian_embed_noise")
class GaussianEmbedNoiseExplorer(TopKMixExplorer):
    """The release's ``gaussian_embed_noise`` strategy: the ``topk`` mixture plus Gaussian noise
    of std ``noise_rms_scale x RMS(mixture)`` (release default 0.33)."""

    uses_embeddings = True

    def __init__(
        self,
        k: int = 3,
        rho: float = 0.1,
        noise_rms_scale: float = 0.33,
        mix_temperature: float = 1.0,
        answer_start: str | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
    ):
        super().__init__(k, rho, mix_temperature, answer_start, temperature, top_k, top_p, min_p)
        self.noise_rms_scale = float(check_range("noise_rms_scale", noise_rms_scale, 0.0))

    def step(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> ExplorerStep:
        step = super().step(logits, generator)
        emb = self.embeddings
        mixture = (step.weights.to(emb.device)[..., None] * emb[step.ids.to(emb.device)].float()).sum(1)
        step.noise_scale = (self.noise_rms_scale * mixture.pow(2).mean(-1).sqrt()).to(logits.device)
        step.noise_seed = torch.randint(0, SEED_HIGH, (len(step.tokens),), generator=generator, device=logits.device)
        return step
