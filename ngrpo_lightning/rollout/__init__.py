"""Rollouts: the batch and its records, reconstruction, engines, and the DataModule."""

from .batch import RolloutBatch
from .engine import RolloutEngine
from .hf_engine import HFEngine
from .reconstruction import build_inputs_embeds, mixture_embeddings
from .records import InputRecords

__all__ = ["HFEngine", "InputRecords", "RolloutBatch", "RolloutEngine", "build_inputs_embeds", "mixture_embeddings"]
from .datamodule import RolloutDataModule  # noqa: E402
from .engines import ENGINES, build_engine, check_engine  # noqa: E402

__all__ += ["ENGINES", "RolloutDataModule", "build_engine", "check_engine"]
