"""The training settings as validated dataclasses: ``optim.*``, ``train.*`` and ``replay.*``.

Fields, types and defaults are the schema's (:mod:`ngrpo_lightning.schema`); these classes add the ranges and the
behaviour. A wrong value fails at construction with its full key: ``OptimConfig(lr=-1)`` -> ``optim.lr=-1 is out of
range: allowed (0.0, inf]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ngrpo_lightning.checks import check_bool, check_choice, check_number
from ngrpo_lightning.schema import OptimSchema, ReplaySchema, TrainSchema

__all__ = ["OptimConfig", "ReplayConfig", "TrainConfig"]


@dataclass
class OptimConfig(OptimSchema):
    """Optimizer, schedule, and the memory of the training forward (``optim.*``). ``micro_batch_size`` and
    ``max_tokens_per_micro_batch`` bound one forward/backward (:class:`~ngrpo_lightning.training.planning.UpdatePlan`)
    without changing the gradients; how the passes compute is the backend's choice (:mod:`ngrpo_lightning.backends`).
    """

    def __post_init__(self):
        check_number("optim.lr", self.lr, 0.0, low_open=True)
        check_number("optim.weight_decay", self.weight_decay, 0.0)
        self.betas = tuple(self.betas)
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas={list(self.betas)!r} must be two numbers, e.g. [0.9, 0.999]")
        for i, beta in enumerate(self.betas):
            check_number(f"optim.betas[{i}]", beta, 0.0, 1.0)
        check_number("optim.warmup_steps", self.warmup_steps, 0, integer=True)
        check_number("optim.grad_clip", self.grad_clip, 0.0, optional=True)
        check_number("optim.micro_batch_size", self.micro_batch_size, 0, integer=True)
        check_number(
            "optim.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, 1, integer=True, optional=True
        )

    def build(self, params: list[torch.nn.Parameter], sharded: bool = False):
        """``(AdamW, LambdaLR)`` over ``params``: linear warm-up, then constant. AdamW is fused (one kernel per tensor)
        on plain CPU/CUDA tensors; ``sharded`` FSDP2 parameters take the default."""
        fused = not sharded and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        opt = torch.optim.AdamW(
            params, lr=self.lr, betas=tuple(self.betas), weight_decay=self.weight_decay, fused=fused or None
        )
        warmup = max(int(self.warmup_steps), 0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        return opt, sched


DROP_GROUPS = ("equal", "all_correct")
TIS_LEVELS = ("auto", "token", "sequence", "geometric")
TIS_MODES = ("truncate", "mask")
DEFAULT_STALE_CAP = 2.0  # the importance weight cap of a run with max_staleness > 0 and no tis_cap


@dataclass
class TrainConfig(TrainSchema):
    """How a step's rollouts become optimizer updates (``train.*``).

    A step makes ``ppo_epochs x num_mini_batches`` optimizer steps; ``trainer.max_steps`` counts them.
    ``dynamic_sampling`` (DAPO) drops groups whose rewards are all equal and refills from up to ``max_extra_rollouts``
    more prompt batches (``drop_groups=all_correct``: only all-correct groups, as NGRPO). ``tis_cap`` weights each
    fresh token's gradient by ``min(p_train_old / p_rollout, tis_cap)`` (null = off), per token, sequence or geometric
    mean (``tis_level``; ``auto``: token for GRPO, geometric for GSPO); ``tis_mode=mask`` zeroes weights above the
    cap. ``max_staleness`` > 0 rolls out that many steps ahead (:mod:`ngrpo_lightning.rollout.ahead`), the weights
    correcting for it (``tis_cap`` defaults to 2.0 then).
    """

    @property
    def importance_cap(self) -> float | None:
        """The cap of the importance weights: ``tis_cap``, or 2.0 under ``max_staleness`` > 0."""
        if self.tis_cap is None and self.max_staleness:
            return DEFAULT_STALE_CAP
        return self.tis_cap

    def importance_level(self, objective) -> str:
        """``tis_level`` for ``objective`` (``auto`` resolved); ``ValueError`` naming the keys when per-token weights
        meet an objective whose advantages are per sequence."""
        per_token = getattr(objective, "token_advantages", False)
        level = self.tis_level if self.tis_level != "auto" else "token" if per_token else "geometric"
        if self.importance_cap is not None and level == "token" and not per_token:
            raise ValueError(
                f"train.tis_level=token needs an objective that takes per-token advantages; "
                f"{type(objective).__name__} does not (GRPO does): use train.tis_level=sequence or geometric"
            )
        return level

    def __post_init__(self):
        check_number("train.ppo_epochs", self.ppo_epochs, 1, integer=True)
        check_number("train.num_mini_batches", self.num_mini_batches, 1, integer=True)
        check_bool("train.dynamic_sampling", self.dynamic_sampling)
        check_number("train.max_extra_rollouts", self.max_extra_rollouts, 0, integer=True)
        check_choice("train.drop_groups", self.drop_groups, DROP_GROUPS)
        check_number("train.tis_cap", self.tis_cap, 0.0, low_open=True, optional=True)
        check_choice("train.tis_level", self.tis_level, TIS_LEVELS)
        check_choice("train.tis_mode", self.tis_mode, TIS_MODES)
        check_number("train.max_staleness", self.max_staleness, 0, integer=True)


@dataclass
class ReplayConfig(ReplaySchema):
    """Replay of past successes into all-wrong groups (``replay.*``; ``ngrpo_lightning.callbacks.ReplayBuffer``)."""

    def __post_init__(self):
        check_number("replay.capacity", self.capacity, 0, integer=True)
        check_number("replay.max_staleness", self.max_staleness, 1, integer=True)
        check_number("replay.is_cap", self.is_cap, 1.0)
