"""Rollouts generated ahead of training: bounded staleness (``train.max_staleness``).

With ``max_staleness = k > 0`` step ``b``'s rollouts are generated from the weights after step ``b - k`` while steps
``b - k .. b - 1`` train, on a worker thread (PyTorch's kernels release the GIL) with its own intra-op threads
(``ahead_threads``), copy of the policy and engine; each job carries a snapshot of the weights, so the worker never
reads weights the optimizer is changing (:mod:`.worker_copy`). Costs and when it pays: ``docs/async.md``. An engine
with weights of its own (vLLM) is not built twice: the worker drives the run's (``shared_engine``), synced from its
copy, sampling from its own generator stream; the run's other rollouts use it only while the worker is idle
(:meth:`RolloutsAhead.settle`). The schedule depends on the step index, not timing: the job for step ``b + k`` is
submitted when step ``b`` starts, and jobs run in order on one sampling generator. So a run gives the same rollouts
however fast either side is, and a checkpoint can hold the rollouts in flight so that ``resume=last`` continues exactly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.rollout.engine import RolloutEngine, full_named_tensors
from ngrpo_lightning.rollout.worker_copy import worker_copy

__all__ = ["RolloutsAhead"]

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (pass over the data, batch index in it)


class RolloutsAhead:
    """A worker thread that rolls out training batches ahead of the step that trains on them.

    Args:
        policy: the live policy; the worker decodes with a copy of it (:mod:`.worker_copy`).
        make_engine: builds the worker's engine for a model (the DataModule's engine settings).
        threads: intra-op threads of the worker.
        shared_engine: drive this engine (the run's vLLM) instead of building one; never closed here.
        backend: the run's backend, which prepares the plain copy of a sharded policy.
        sharded_root: where FSDP2 shards ``policy``, its root module (every snapshot is then a gather).
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        make_engine: Callable[[torch.nn.Module], RolloutEngine],
        threads: int,
        shared_engine: RolloutEngine | None = None,
        backend=None,
        sharded_root: torch.nn.Module | None = None,
    ):
        self.policy = policy
        self.copy = worker_copy(policy, backend, sharded_root)
        self.model = self.copy.model
        self.shared = shared_engine is not None
        self.engine = shared_engine if self.shared else make_engine(self.model)
        # the training rollouts' sampling state in a shared engine (seeded as an engine of their own would be)
        self._stream = {"seed": self.engine.seed, "generator": None}
        self.threads = threads
        self.version: int | None = None  # the policy version of the worker's weights
        self._queued_version: int | None = None  # that of the last job queued
        self.pending: dict[Key, Future] = {}
        self.ready: dict[Key, RolloutBatch] = {}  # restored from a checkpoint
        self._last_end: float | None = None
        self._executor = ThreadPoolExecutor(1, "ngrpo-rollouts", initializer=torch.set_num_threads, initargs=(threads,))

    # -------------------------------------------------------------- jobs
    def submit(self, key: Key, generate: Callable[[RolloutEngine], RolloutBatch], weights: dict, version: int) -> None:
        """Queue the rollout of batch ``key``: ``generate(engine)`` once the worker's weights are ``weights`` (a
        :meth:`snapshot` of policy ``version``, or none where the job queued before it has that version)."""
        self.pending[key] = self._queue(generate, weights, version)

    def _queue(self, generate, weights: dict, version: int) -> Future:
        """The job on the worker, after those queued before it."""
        self._queued_version = version
        return self._executor.submit(self._run, generate, [weights], version, time.perf_counter())

    def _weights_for(self, version: int, weights: Callable[[], dict]) -> dict:
        """``weights()``, or none where the last job queued has ``version``; every rank decides alike (FSDP2)."""
        return {} if version == self._queued_version else weights()

    def _run(self, generate, holder: list[dict], version: int, submitted: float) -> RolloutBatch:
        # the worker waited for the trainer when this job came after the previous one had ended
        idle = max(0.0, submitted - self._last_end) if self._last_end is not None else 0.0
        weights = holder.pop()  # the job's only reference: the copy is freed once loaded
        if version != self.version:
            if not weights:
                raise RuntimeError(f"a rollout job of policy version {version} came without its weights")
            self.copy.load(weights)
            self.version = version
        del weights
        with self._own_stream():
            if self.shared and self.engine.weights_version != version:
                self.engine.sync_weights(full_named_tensors(self.model), version=version)
            batch = generate(self.engine)
        self._last_end = time.perf_counter()
        batch.stats.update({"async/weights_version": float(version), "async/generator_wait_s": idle})
        return batch

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The policy's weights as a job carries them, taken now on the training thread (:mod:`.worker_copy`)."""
        return self.copy.snapshot(self.policy)

    @contextmanager
    def _own_stream(self) -> Iterator[None]:
        """A shared engine samples the training rollouts from their own generator state, swapped in for the job."""
        if not self.shared:
            yield
            return
        others = self.engine.state_dict()
        self.engine.load_state_dict(self._stream)
        try:
            yield
        finally:
            self._stream = self.engine.state_dict()
            self.engine.load_state_dict(others)

    def rollouts_for(
        self,
        key: Key,
        upcoming: list[Key],
        job: Callable[[Key], Callable[[RolloutEngine], RolloutBatch]],
        weights: Callable[[], dict],
        version: int,
    ) -> RolloutBatch:
        """The rollouts of batch ``key`` (waiting for them), after queueing it and ``upcoming`` where not queued yet:
        ``job(k)`` rolls batch k out on the current ``weights()`` (policy ``version``)."""
        snapshot = None
        for k in [key, *upcoming]:
            if not self.queued(k):
                snapshot = snapshot if snapshot is not None else self._weights_for(version, weights)
                self.submit(k, job(k), snapshot, version)
        batch = self.take(key)
        batch.stats["async/staleness"] = float(version - batch.stats["async/weights_version"])
        return batch

    def run_now(
        self, generate: Callable[[RolloutEngine], RolloutBatch], weights: Callable[[], dict], version: int
    ) -> RolloutBatch:
        """A rollout outside the schedule (dynamic sampling's extra batches), after the queued ones (the worker owns the
        engine's generator, so its draws stay in one order)."""
        return self._queue(generate, self._weights_for(version, weights), version).result()

    def take(self, key: Key) -> RolloutBatch | None:
        """The rollouts of batch ``key`` (waiting for them), or ``None`` if it was never queued."""
        if key in self.ready:  # waited for already (a checkpoint, a validation on a shared engine) or restored
            batch = self.ready.pop(key)
            batch.stats.setdefault("async/trainer_wait_s", 0.0)
            return batch
        future = self.pending.pop(key, None)
        if future is None:
            return None
        t0 = time.perf_counter()
        batch = future.result()
        batch.stats["async/trainer_wait_s"] = time.perf_counter() - t0
        return batch

    def queued(self, key: Key) -> bool:
        return key in self.pending or key in self.ready

    def settle(self) -> dict[Key, RolloutBatch]:
        """Wait for every queued rollout; all of them, by key (they stay queued)."""
        for key, future in list(self.pending.items()):
            self.ready[key] = future.result()
            del self.pending[key]
        return dict(self.ready)

    # ------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """The rollouts in flight (waited for) and the worker engine's sampling state after them."""
        ready = {key: batch.state_dict() for key, batch in self.settle().items()}
        return {"ready": ready, "engine": self._stream if self.shared else self.engine.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.ready = {}
        for key, batch in (state.get("ready") or {}).items():
            try:
                self.ready[key] = RolloutBatch.from_state_dict(batch)
            except ValueError as err:  # made again when its step comes
                log.warning("a rollout in flight is dropped from the checkpoint and made again: %s", err)
        if state.get("engine") is None:
            return
        if self.shared:
            self._stream = dict(state["engine"])
        else:
            self.engine.load_state_dict(state["engine"])

    def close(self) -> None:
        """Stop the worker; rollouts queued and not started are dropped. A shared engine stays open."""
        for future in self.pending.values():
            future.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.pending.clear()
        if not self.shared:
            self.engine.close()
