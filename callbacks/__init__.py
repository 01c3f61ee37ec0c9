"""Lightning callbacks of ngrpo-lightning: sample tables and the replay buffer."""

from .replay_buffer import ReplayBuffer
from .sample_table import RolloutSamplesLogger

__all__ = ["ReplayBuffer", "RolloutSamplesLogger"]
