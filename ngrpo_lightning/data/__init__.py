"""Training data: problems (reasoning-gym tasks by default, files or Hugging Face datasets) and tokenized prompts."""

from ngrpo_lightning.data.loaders import MissingFieldError, load_problems
from ngrpo_lightning.data.problem import Problem
from ngrpo_lightning.data.prompts import DEFAULT_INSTRUCTION, PromptDataset, collate_prompts, render_prompt
from ngrpo_lightning.data.reasoning_gym import reasoning_gym_problems

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
