"""Training data: problems (reasoning-gym tasks, the built-in default, or files / Hugging Face datasets) and
the tokenized prompts the rollout engine consumes."""

from .loaders import MissingFieldError, load_problems
from .problem import Problem
from .prompts import DEFAULT_INSTRUCTION, PromptDataset, collate_prompts, render_prompt
from .reasoning_gym import reasoning_gym_problems

__all__ = [
    "DEFAULT_INSTRUCTION",
    "MissingFieldError",
    "Problem",
    "PromptDataset",
    "collate_prompts",
    "load_problems",
    "reasoning_gym_problems",
    "render_prompt",
]
