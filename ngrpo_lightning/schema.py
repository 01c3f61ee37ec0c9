"""The typed schema of the run's training settings: ``optim.*``, ``train.*`` and ``replay.*``.

Each default lives here once, with its type and what it means. The dataclasses are registered
in Hydra's ConfigStore (:func:`register`) and ``conf/config.yaml`` places them at ``optim``,
``train`` and ``replay``, so composing a run checks every value's type against them (a
command-line ``optim.lr=fast`` fails naming ``optim.lr``), and an experiment's or the command
line's values merge onto these defaults. ``ngrpo config`` prints the composed values.
:mod:`ngrpo_lightning.training.settings` adds the ranges and the behaviour on top.

No torch here: the schema is read before any model library loads.
"""

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore

__all__ = ["OptimSchema", "ReplaySchema", "TrainSchema", "register"]


@dataclass
class OptimSchema:
    """Optimizer, schedule, and the memory of the training forward (``optim.*``)."""

    lr: float = 2.0e-5  # paper: 1e-6 for billion-parameter models and 1 epoch of DeepScaleR
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0  # in optimizer steps
    grad_clip: Optional[float] = 1.0  # max global gradient norm (null or 0 = no clipping)  # noqa: UP045
    micro_batch_size: int = 0  # rollouts per forward/backward (0 = the whole mini-batch at once)
    # token budget per forward/backward: rows grouped by length, each micro-batch cut to its longest
    # sequence (null = no budget; at least the prompt limit + rollout.max_new_tokens)
    max_tokens_per_micro_batch: Optional[int] = None  # noqa: UP045


@dataclass
class TrainSchema:
    """How a step's rollouts become optimizer updates (``train.*``)."""

    ppo_epochs: int = 1  # passes over each step's rollouts (> 1: later updates see ratios != 1, the clip acts)
    # optimizer updates per pass: a step makes ppo_epochs x num_mini_batches optimizer steps, and
    # trainer.max_steps counts optimizer steps (Lightning's global_step)
    num_mini_batches: int = 1
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, roll out more prompts to refill
    max_extra_rollouts: int = 4  # at most this many extra prompt batches per step (then train on what is kept)
    drop_groups: str = "equal"  # which groups it drops: equal (all right or all wrong) | all_correct (NGRPO)
    # truncated importance sampling of the rollout/train mismatch: per-token weight
    # min(p_train_old / p_rollout, tis_cap) on the policy gradient (null = off, 2.0 when max_staleness > 0)
    tis_cap: Optional[float] = None  # noqa: UP045
    # token | sequence (product of the ratios) | geometric (their geometric mean) | auto (token for
    # GRPO, geometric for GSPO)
    tis_level: str = "auto"
    tis_mode: str = "truncate"  # truncate: weight min(ratio, cap) | mask: weight 0 above the cap
    # > 0: roll out k steps ahead on a worker thread while training runs (rollouts from weights <= k
    # steps old; docs/async.md). 0: each step rolls out first
    max_staleness: int = 0


@dataclass
class ReplaySchema:
    """Past successes replayed into groups whose fresh rollouts are all wrong (``replay.*``)."""

    capacity: int = 0  # prompts whose latest success is kept (0 = no replay)
    max_staleness: int = 4  # a success is replayed at most this many steps after it was sampled
    is_cap: float = 2.0  # cap of a replayed trajectory's importance weight


SCHEMAS = {"optim": OptimSchema, "train": TrainSchema, "replay": ReplaySchema}


def register() -> None:
    """Put the schemas in Hydra's ConfigStore as ``schema/<node>`` (``conf/config.yaml`` places
    them); idempotent."""
    store = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        store.store(group="schema", name=name, node=node)
