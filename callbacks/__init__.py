"""Lightning callbacks of ngrpo-lightning: sample tables (and, later, replay buffer, Pass@k)."""

from .sample_table import RolloutSamplesLogger

__all__ = ["RolloutSamplesLogger"]
