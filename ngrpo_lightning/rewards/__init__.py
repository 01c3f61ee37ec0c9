"""Verifiable math rewards: answer extraction, math-verify equivalence, checks in workers under a hard time limit.

``MathReward``/``RewardResult`` are imported lazily, so verifier workers never import torch."""

from ngrpo_lightning.rewards.extract import EXTRACT_METHODS, extract_answer
from ngrpo_lightning.rewards.verify import verify_answer

__all__ = [
    "EXTRACT_METHODS",
    "STATUSES",
    "MathReward",
    "RewardResult",
    "extract_answer",
    "score_responses",
    "verify_answer",
]


def __getattr__(name: str):
    if name in ("MathReward", "RewardResult", "STATUSES", "score_responses"):
        from ngrpo_lightning.rewards import reward

        return getattr(reward, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
