"""Ctrl-C during training: the first stops the run after the step under way, which is then
checkpointed; a second stops it at once.

Lightning turns Ctrl-C into a teardown wherever it lands, so a run stopped mid-step kept only its
last periodic checkpoint (with ``checkpoint.every_n_steps=10``, none at all for a 6-step run), and
a save at that moment would hold a half-made step: the next batch already taken from the data,
its rollout cut off. Here the first Ctrl-C only asks to stop: at the end of the step Lightning is
told to stop (``trainer.should_stop``, which it agrees on across processes), the fit ends as at
``max_steps``, and :class:`~ngrpo_lightning.checkpoints.run.RunCheckpoint` saves the last step as it
saves a run's final one. ``resume=last`` continues from there. SIGTERM (a scheduler's stop) is
Lightning's own: it stops after the step under way, and ``RunCheckpoint`` saves that step too.
"""

from __future__ import annotations

import signal
import sys
import threading

import lightning as L


class StopOnInterrupt(L.Callback):
    """The first SIGINT (Ctrl-C) asks the fit to stop after the step under way; a second raises
    ``KeyboardInterrupt`` at once (the previous handler is back after the first)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.requested = False
        if threading.current_thread() is threading.main_thread():  # only there can a handler be set
            self._previous = signal.signal(signal.SIGINT, self._request)

    def _request(self, signum, frame) -> None:
        self.requested = True
        self._restore()  # a second Ctrl-C stops at once
        print(
            "\nngrpo: Ctrl-C: stopping after the step under way and saving it (Ctrl-C again stops at once)",
            file=sys.stderr,
            flush=True,
        )

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if self.requested:
            trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
