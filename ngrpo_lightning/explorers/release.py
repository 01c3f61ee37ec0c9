"""The N-GRPO release's baselines (``ZJUSCL/N-GRPO``, its ``mix_strategy`` values), as explorers.

All four emit the sampled token and, on a gated step (Bernoulli(``rho``), the release's ``mix_rate``), feed a mixture of
the ``k`` likeliest tokens instead. Unlike the release, noise comes from a recorded seed (training rebuilds the exact
input) and the mixture uses the input embedding matrix ``E``. ``z~``: the warped logits, ``tau``: ``mix_temperature``:

* ``topk``: the set is ``topk(z~ / tau, k)``, weighted ``softmax(z~[set] / tau)``.
* ``topk_gumbel``: the set is ``topk(z~ / tau + g, k)`` with Gumbel noise ``g``; the same weights.
* ``gaussian_embed_noise``: the ``topk`` mixture plus Gaussian noise of standard deviation
  ``noise_rms_scale x RMS(mixture)`` per element (RMS over the hidden dimension).
* ``orthogonal_noise``: the top-1 embedding ``a = E[t_1]`` plus Gaussian noise ``sum_j s_j z_j``,
  ``z_j ~ N(0, I_d)``, ``s_j = w_j ||r_j||`` with ``r_j`` the part of ``E[t_j]`` orthogonal to ``a`` and
  ``w = softmax(z~[t_2..t_k] / tau^2)`` (as the release's SGLang path). Drawn as one Gaussian of std
  ``sqrt(sum_j s_j^2)``, equal in distribution."""

from __future__ import annotations

import torch

from ngrpo_lightning.explorers.base import ExplorerStep, check_answer_start, check_range, register_explorer
from ngrpo_lightning.explorers.gaussian import noise_seeds
from ngrpo_lightning.explorers.temperature import TemperatureExplorer


@register_explorer("topk")
class TopKMixExplorer(TemperatureExplorer):
    """The release's ``topk`` strategy (see the module docstring).

    Args:
        k: tokens in each mixture; rho: probability a row's step is mixed;
        mix_temperature: tau; answer_start: no mixing after this marker (release: ``"</think>"``);
        temperature, top_k, top_p, min_p: the sampling.
    """

    gumbel = False
    capturable = True  # recorded with the model's step on a GPU (rollout/step_graphs.py)

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
        self.k = int(check_range("k", k, 1, integer=True))
        self.rho = float(check_range("rho", rho, 0.0, 1.0))
        self.mix_temperature = float(check_range("mix_temperature", mix_temperature, 0.0, low_open=True))

    def step(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> ExplorerStep:
        mixed, tokens, scores, ids = self.top_tokens(logits, generator)
        return ExplorerStep(tokens=tokens, mixed=mixed, ids=ids, weights=scores.gather(-1, ids).softmax(-1))

    def top_tokens(self, logits: torch.Tensor, generator: torch.Generator | None):
        """The gate, the sampled tokens, the scores ``z~ / tau`` and the ``k`` chosen ids (best first)."""
        mixed = torch.rand(logits.shape[0], generator=generator, device=logits.device) < self.rho
        tokens = self.sample(logits, generator)
        scores = self.warp(logits) / self.mix_temperature
        select = scores
        if self.gumbel:
            u = torch.rand(scores.shape, generator=generator, device=scores.device).clamp_(1e-6, 1 - 1e-6)
            select = scores - torch.log(-torch.log(u))
        return mixed, tokens, scores, select.topk(self.k, dim=-1).indices


@register_explorer("topk_gumbel")
class TopKGumbelMixExplorer(TopKMixExplorer):
    """The release's ``topk-gumbel`` strategy: Gumbel noise chooses the set, not the weights."""

    gumbel = True


@register_explorer("gaussian_embed_noise")
class GaussianEmbedNoiseExplorer(TopKMixExplorer):
    """The release's ``gaussian_embed_noise`` strategy: the ``topk`` mixture plus Gaussian noise
    of std ``noise_rms_scale x RMS(mixture)`` (release default 0.33)."""

    capturable = True

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
        step.noise_seed = noise_seeds(len(step.tokens), generator, logits.device)
        return step


@register_explorer("orthogonal_noise")
class OrthogonalNoiseExplorer(TopKMixExplorer):
    """The release's ``orthogonal_noise`` strategy (module docstring); ``k = 1`` feeds the top-1 embedding alone."""

    capturable = True

    def step(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> ExplorerStep:
        mixed, tokens, scores, ids = self.top_tokens(logits, generator)
        emb = self.embeddings
        e = emb[ids.to(emb.device)].float()  # [B, k, d]
        anchor, others = e[:, 0], e[:, 1:]
        coef = (others * anchor[:, None]).sum(-1) / anchor.pow(2).sum(-1, keepdim=True).clamp(min=1e-6)
        residual = (others - coef[..., None] * anchor[:, None]).norm(dim=-1).clamp(min=1e-6)  # [B, k-1]
        w = (scores.gather(-1, ids[:, 1:]).to(emb.device) / self.mix_temperature).softmax(-1)
        scale = (w * residual).pow(2).sum(-1).sqrt()  # 0 when k == 1
        seeds = noise_seeds(len(tokens), generator, logits.device)
        return ExplorerStep(
            tokens=tokens,
            mixed=mixed,
            ids=ids[:, :1],
            weights=torch.ones(len(tokens), 1, device=logits.device),
            noise_seed=seeds,
            noise_scale=scale.to(logits.device),
        )
