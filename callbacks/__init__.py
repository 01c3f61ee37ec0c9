"""Lightning callbacks: sample tables, the replay buffer, Pass@k evaluation, the update's memory check.

The top-level `callbacks/` folder installs as `ngrpo_lightning.callbacks`, the one import path.
"""

from ngrpo_lightning.callbacks.pass_at_k import PassAtK
from ngrpo_lightning.callbacks.replay_buffer import ReplayBuffer
from ngrpo_lightning.callbacks.sample_table import RolloutSamplesLogger
from ngrpo_lightning.callbacks.update_memory import UpdateMemoryCheck

__all__ = ["PassAtK", "ReplayBuffer", "RolloutSamplesLogger", "UpdateMemoryCheck"]
