"""Explorers: how each decoding step's next input is formed (see :mod:`.base`).

Registered names (``explorer.name=``): ``temperature``, ``neighbor`` (N-GRPO), ``gaussian`` (STHT), ``gumbel``, and
the release's ``topk``, ``topk_gumbel``, ``gaussian_embed_noise``, ``orthogonal_noise``; any other :class:`Explorer`
subclass through ``explorer._target_=``."""

from ngrpo_lightning.explorers.base import (
    EXPLORERS,
    Explorer,
    ExplorerStep,
    check_choice,
    check_explorer,
    check_range,
    declares_capturable,
    explorer_step,
    register_explorer,
)
from ngrpo_lightning.explorers.gaussian import GaussianNoiseExplorer
from ngrpo_lightning.explorers.gumbel import GumbelSoftExplorer
from ngrpo_lightning.explorers.neighbor import NeighborMixingExplorer
from ngrpo_lightning.explorers.neighbor_index import METRICS, NeighborIndex
from ngrpo_lightning.explorers.release import (
    GaussianEmbedNoiseExplorer,
    OrthogonalNoiseExplorer,
    TopKGumbelMixExplorer,
    TopKMixExplorer,
)
from ngrpo_lightning.explorers.sampling import filter_logits, sample_tokens
from ngrpo_lightning.explorers.temperature import TemperatureExplorer

__all__ = [
    "EXPLORERS",
    "METRICS",
    "Explorer",
    "ExplorerStep",
    "GaussianEmbedNoiseExplorer",
    "GaussianNoiseExplorer",
    "GumbelSoftExplorer",
    "NeighborIndex",
    "NeighborMixingExplorer",
    "OrthogonalNoiseExplorer",
    "TemperatureExplorer",
    "explorer_step",
    "TopKGumbelMixExplorer",
    "TopKMixExplorer",
    "check_choice",
    "check_explorer",
    "check_range",
    "declares_capturable",
    "filter_logits",
    "register_explorer",
    "sample_tokens",
]
