"""Rollouts: the batch and its records, reconstruction, engines (a registry), and the DataModule."""

from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.rollout.datamodule import RolloutDataModule  # noqa: E402  (after the engines it builds)
from ngrpo_lightning.rollout.engine import ENGINES, RolloutEngine, RolloutStart, register_engine
from ngrpo_lightning.rollout.engines import build_engine, check_engine, engine_class
from ngrpo_lightning.rollout.hf_engine import HFEngine
from ngrpo_lightning.rollout.reconstruction import build_inputs_embeds, mixture_embeddings, mixture_vectors
from ngrpo_lightning.rollout.records import InputRecords
from ngrpo_lightning.rollout.vllm_engine import VLLMEngine

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
    "mixture_vectors",
    "register_engine",
]
