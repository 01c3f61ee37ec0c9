"""ngrpo-lightning: RL for language models on verifiable math, with pluggable exploration.

A run composes an :class:`~ngrpo_lightning.explorers.Explorer` with a
:class:`~ngrpo_lightning.objectives.PolicyObjective` inside
:class:`~ngrpo_lightning.training.module.RLModule`, fed by
:class:`~ngrpo_lightning.rollout.RolloutDataModule`.
"""

__version__ = "0.1.0"
