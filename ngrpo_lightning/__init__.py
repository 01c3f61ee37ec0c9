"""ngrpo-lightning: RL for language models on verifiable math, with pluggable exploration.

A run composes an :class:`Explorer` with a :class:`PolicyObjective` inside :class:`RLModule`, fed
by :class:`RolloutDataModule`. What a script needs is importable from here::

    from ngrpo_lightning import GRPO, NeighborMixingExplorer, RLModule, RolloutDataModule, load_policy

The names below are the public API (``__all__``): a name that moves keeps working for a release with
a ``DeprecationWarning`` naming its new home. They load on first use, so the import stays cheap."""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

# public name -> the module that defines it (and its name there, where it differs)
_PUBLIC = {
    # the LightningModule and the DataModule
    "RLModule": "ngrpo_lightning.training.module",
    "RolloutDataModule": "ngrpo_lightning.rollout",
    "RolloutBatch": "ngrpo_lightning.rollout",
    "RolloutEngine": "ngrpo_lightning.rollout",
    "HFEngine": "ngrpo_lightning.rollout",
    # explorers
    "Explorer": "ngrpo_lightning.explorers",
    "ExplorerStep": "ngrpo_lightning.explorers",
    "register_explorer": "ngrpo_lightning.explorers",
    "check_explorer": "ngrpo_lightning.explorers",
    "TemperatureExplorer": "ngrpo_lightning.explorers",
    "NeighborMixingExplorer": "ngrpo_lightning.explorers",
    "GaussianNoiseExplorer": "ngrpo_lightning.explorers",
    "GumbelSoftExplorer": "ngrpo_lightning.explorers",
    "TopKMixExplorer": "ngrpo_lightning.explorers",
    "TopKGumbelMixExplorer": "ngrpo_lightning.explorers",
    "GaussianEmbedNoiseExplorer": "ngrpo_lightning.explorers",
    "OrthogonalNoiseExplorer": "ngrpo_lightning.explorers",
    # objectives
    "PolicyObjective": "ngrpo_lightning.objectives",
    "register_objective": "ngrpo_lightning.objectives",
    "check_objective": "ngrpo_lightning.objectives",
    "GRPO": "ngrpo_lightning.objectives",
    "GSPO": "ngrpo_lightning.objectives",
    # models
    "load_policy": "ngrpo_lightning.models.loading",
    "load_tokenizer": "ngrpo_lightning.models.loading",
    "LoraSettings": "ngrpo_lightning.models.lora",
    "apply_lora": ("ngrpo_lightning.models.lora", "apply"),
    # problems
    "Problem": "ngrpo_lightning.data",
    "load_problems": "ngrpo_lightning.data",
    "reasoning_gym_problems": "ngrpo_lightning.data",
    "load_benchmark": "ngrpo_lightning.data.benchmarks",
    # the reward
    "MathReward": "ngrpo_lightning.rewards",
    # callbacks and metrics
    "ReplayBuffer": "ngrpo_lightning.callbacks",
    "PassAtK": "ngrpo_lightning.callbacks",
    "PassAtKMetric": ("ngrpo_lightning.metrics", "PassAtK"),
    "pass_at_k": "ngrpo_lightning.metrics",
    # checkpoints and export
    "load_checkpoint": "ngrpo_lightning.checkpoints.safe_load",
    "export_checkpoint": "ngrpo_lightning.checkpoints.export",
    # configs, the builder a script shares with `ngrpo train`, and the training job
    "build_run": "ngrpo_lightning.build.run",
    "Run": "ngrpo_lightning.build.run",
    "compose": "ngrpo_lightning.config",
    "ConfigError": "ngrpo_lightning.config",
    "train": "ngrpo_lightning.commands.train",
    "compare": ("ngrpo_lightning.commands.compare.command", "run_compare"),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ngrpo_lightning' has no attribute {name!r}")
    module, attribute = _PUBLIC[name] if isinstance(_PUBLIC[name], tuple) else (_PUBLIC[name], name)
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
