"""Lightning callbacks of ngrpo-lightning: sample tables, the replay buffer, Pass@k evaluation."""

from .pass_at_k import PassAtK
from .replay_buffer import ReplayBuffer
from .sample_table import RolloutSamplesLogger

__all__ = ["PassAtK", "ReplayBuffer", "RolloutSamplesLogger"]
