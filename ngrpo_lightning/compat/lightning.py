"""Lightning internals the package reads, tested on lightning 2.6.

The run's checkpoint callbacks (``checkpoints/run.py``, ``checkpoints/best.py``) subclass ``ModelCheckpoint`` and save
at moments Lightning's rules do not (the final step, a Pass@k evaluation, the validation after a fit) through its save
methods and bookkeeping, the step's metrics sent first through the trainer's logger connector. The distributed
checkpoint writer asks whether it writes one folder per rank.
"""

from __future__ import annotations

from ngrpo_lightning.compat import Library

TESTED = {"lightning": ">=2.6,<2.7"}
LIGHTNING = Library("lightning", TESTED)
LIGHTNING.warn_if_untested()

__all__ = [
    "TESTED",
    "batches_that_stepped",
    "every_n_train_steps",
    "last_global_step_saved",
    "monitor_candidates",
    "save_last",
    "save_topk",
    "saves_distributed_checkpoint",
    "send_train_step_metrics",
    "skips_saving",
    "state_key",
]


# ------------------------------------------------------------------ ModelCheckpoint
def state_key(callback, **settings) -> str:
    """The key ``callback``'s state is filed under in a checkpoint (``Callback._generate_state_key(**settings)``)."""
    return LIGHTNING.attribute(callback, "_generate_state_key")(**settings)


def every_n_train_steps(checkpoint) -> int:
    """How many optimizer steps apart ``checkpoint`` (a ``ModelCheckpoint``) saves; 0: not by steps."""
    return LIGHTNING.attribute(checkpoint, "_every_n_train_steps")


def skips_saving(checkpoint, trainer) -> bool:
    """Whether ``checkpoint`` saves nothing now (a sanity check, a step saved already, fast_dev_run, ...)."""
    return LIGHTNING.attribute(checkpoint, "_should_skip_saving_checkpoint")(trainer)


def last_global_step_saved(checkpoint) -> int:
    """The optimizer step of ``checkpoint``'s last save."""
    return LIGHTNING.attribute(checkpoint, "_last_global_step_saved")


def monitor_candidates(checkpoint, trainer) -> dict:
    """The metrics a save of ``checkpoint`` is judged by and its file named from, now."""
    return LIGHTNING.attribute(checkpoint, "_monitor_candidates")(trainer)


def save_topk(checkpoint, trainer, candidates: dict) -> None:
    """Save as ``checkpoint``'s top-k rule does (its ``monitor``, ``save_top_k``) with ``candidates``."""
    LIGHTNING.attribute(checkpoint, "_save_topk_checkpoint")(trainer, candidates)


def save_last(checkpoint, trainer, candidates: dict) -> None:
    """Save (or link) ``checkpoint``'s ``last`` checkpoint with ``candidates``."""
    LIGHTNING.attribute(checkpoint, "_save_last_checkpoint")(trainer, candidates)


# ------------------------------------------------------------------ the trainer
def batches_that_stepped(trainer) -> int:
    """The training loop's count of batches an optimizer step followed: the step Lightning logs metrics at."""
    return LIGHTNING.attribute(trainer.fit_loop.epoch_loop, "_batches_that_stepped")


def send_train_step_metrics(trainer) -> None:
    """Send the step's logged metrics to the trainer's loggers now (the loop does it after the batch's hooks)."""
    connector = LIGHTNING.attribute(trainer, "_logger_connector")
    LIGHTNING.attribute(connector, "update_train_step_metrics")()


# ------------------------------------------------------------------ strategies
def saves_distributed_checkpoint(strategy) -> bool:
    """Whether ``strategy`` (a ``ModelParallelStrategy``) writes a checkpoint as a folder of every rank's shards."""
    return LIGHTNING.attribute(strategy, "_save_distributed_checkpoint")
