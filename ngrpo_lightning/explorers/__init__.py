"""Explorers: how each decoding step's next input is formed (see :mod:`.base`)."""

from .base import EXPLORERS, Explorer, ExplorerStep, register_explorer
from .sampling import filter_logits, sample_tokens
from .temperature import TemperatureExplorer

__all__ = [
    "EXPLORERS",
    "Explorer",
    "ExplorerStep",
    "TemperatureExplorer",
    "filter_logits",
    "register_explorer",
    "sample_tokens",
]
