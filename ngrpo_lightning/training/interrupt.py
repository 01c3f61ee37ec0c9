"""Ctrl-C during training: the first stops the run after the step under way (checkpointed), a second at once.

Lightning tears down wherever Ctrl-C lands, losing the step under way. Here the first Ctrl-C sets
``trainer.should_stop`` at the end of the step, the fit ends as at ``max_steps``, and
:class:`~ngrpo_lightning.checkpoints.run.RunCheckpoint` saves the last step; ``resume=last`` continues from there.
SIGTERM is Lightning's own, saved the same way.
"""

from __future__ import annotations

import signal
import sys
import threading

import lightning as L


class StopOnInterrupt(L.Callback):
    """The first SIGINT (Ctrl-C) asks the fit to stop after the step under way; a second raises ``KeyboardInterrupt``
    at once (the previous handler is back after the first)."""

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
