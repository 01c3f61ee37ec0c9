"""Training data: problems (built-in arithmetic, or files / Hugging Face datasets) and
the tokenized prompts the rollout engine consumes."""

from .arithmetic import ArithmeticTask
from .loaders import MissingFieldError, load_problems
from .problem import Problem
from .prompts import DEFAULT_INSTRUCTION, PromptDataset, collate_prompts, render_prompt

__all__ = [
    "DEFAULT_INSTRUCTION",
    "ArithmeticTask",
    "MissingFieldError",
    "Problem",
    "PromptDataset",
    "collate_prompts",
    "load_problems",
    "render_prompt",
]
