"""What the parts of a run share: the policy and how it computes, the explorers, and the one policy version.

The training module describes the run with a :class:`RunContext` (``RLModule.context``); the DataModule and callbacks
read only that, so a user's LightningModule with a ``context`` drives them too (:func:`run_context`).
:class:`PolicyVersion` counts optimizer steps: the run's one clock for weight syncs and staleness, checkpointed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ngrpo_lightning.backends import Backend
from ngrpo_lightning.explorers import Explorer

__all__ = ["PolicyVersion", "RunContext", "UpdateShape", "run_context"]


class PolicyVersion:
    """Optimizer steps the policy has taken (``value``); :meth:`advance` after each."""

    def __init__(self, value: int = 0):
        self.value = int(value)

    def advance(self) -> int:
        self.value += 1
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = int(state["value"])

    def __repr__(self) -> str:
        return f"PolicyVersion({self.value})"


class UpdateShape(Protocol):
    """How a step's rollouts are cut into optimizer updates and micro-batches (``train.*``, ``optim.*``)."""

    updates_per_step: int
    num_mini_batches: int
    micro_batch_size: int
    max_tokens: int | None


@dataclass(frozen=True)
class RunContext:
    """The run as its DataModule and callbacks see it.

    Attributes:
        policy: the model being trained (a peft model under LoRA).
        tokenizer: its tokenizer.
        explorer: the training rollouts' explorer.
        eval_explorer: the validation rollouts' (plain sampling).
        reward: scores responses (:mod:`ngrpo_lightning.rewards`).
        backend: how the models compute on this device; it also states the KV cache's dtype.
        version: the policy version (see the module docstring).
        update: the update's shape (:class:`UpdateShape`).
        sharded_root: the FSDP2 root of a model, or None when it is not sharded.
        sharded: whether the models are sharded (FSDP2).
    """

    policy: torch.nn.Module
    tokenizer: Any
    explorer: Explorer
    eval_explorer: Explorer
    reward: Any
    backend: Backend
    version: PolicyVersion
    update: UpdateShape
    sharded_root: Callable[[torch.nn.Module], torch.nn.Module | None]
    sharded: bool = False

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device


def run_context(trainer) -> RunContext:
    """The context of the module ``trainer`` runs; a clear error when the module has none."""
    module = getattr(trainer, "lightning_module", None)
    context = getattr(module, "context", None)
    if not isinstance(context, RunContext):
        raise TypeError(
            f"{type(module).__name__} gives no RunContext (its `context`): the rollout DataModule and the "
            "callbacks read the policy, explorers, backend and policy version from it; RLModule provides one"
        )
    return context
