"""Rollouts: the batch and its records, reconstruction, engines (a registry), and the DataModule."""

from .batch import RolloutBatch
from .datamodule import RolloutDataModule  # noqa: E402  (after the engines it builds)
from .engine import ENGINES, RolloutEngine, RolloutStart, register_engine
from .engines import build_engine, check_engine, engine_class
from .hf_engine import HFEngine
from .reconstruction import build_inputs_embeds, mixture_embeddings
from .records import InputRecords
from .vllm_engine import VLLMEngine

__all__ = [
    "ENGINES",
    "HFEngine",
    "InputRecords",
    "RolloutBatch",
    "RolloutDataModule",
    "RolloutEngine",
    "RolloutStart",
    "VLLMEngine",
    "build_engine",
    "build_inputs_embeds",
    "check_engine",
    "engine_class",
    "mixture_embeddings",
    "register_engine",
]
