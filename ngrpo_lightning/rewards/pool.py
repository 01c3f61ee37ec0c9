"""A pool of verifier processes with a HARD per-item time limit.

math-verify/sympy can run for minutes on a pathological answer (``9^{9^{9^{9^{9}}}}``), and only a kill stops a
running C call. Workers are *spawned*, not forked (the trainer holds threads, maybe CUDA state). Two limits per item:

* soft, ``timeout_s`` of the check's CPU time: SIGPROF inside the worker (:mod:`.limits`);
* hard, ``timeout_s + kill_grace_s`` of the item's own time since its start (a shared progress array,
  :mod:`.worker`): the parent kills the pool, marks the item ``timeout``, re-runs the others in a fresh pool.

Both count what the check spends (CPU; the hard one also sleep), not waits for a core (:class:`_Charged`); a wall-clock
backstop (:data:`_BACKSTOP_FACTOR` x the limit) ends anything. Items in progress at a worker crash are checked again
once, ``error`` at a second. Workers start while ``__main__`` is empty, so they do not import the parent's script."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import time
import types
import weakref
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from ngrpo_lightning.compat.stdlib import executor_processes
from ngrpo_lightning.rewards import worker

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often the parent looks for overrunning items
_MAX_STALLED_ROUNDS = 2  # restarts without progress before the remaining items count as errors
_BACKSTOP_FACTOR = 10  # a wall-clock limit of this many times the hard limit (at least _BACKSTOP_MIN_S)
_BACKSTOP_MIN_S = 60.0


@contextlib.contextmanager
def _main_script_hidden():
    """``__main__`` is an empty module meanwhile: processes spawned now do not import the parent's script."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class VerifierPool:
    """Lazily started, reused across calls; ``close()`` or interpreter exit shuts it down."""

    def __init__(self, num_workers: int, start_timeout_s: float = 120.0):
        self.num_workers = num_workers
        self.start_timeout_s = start_timeout_s
        self.restarts = 0  # pools killed because of an overrun or a crash
        self._ctx = multiprocessing.get_context("spawn")
        self._state = _PoolState()
        self._call_id = 0
        self._charged = _Charged()
        self._crashed: set[int] = set()  # items of the current run() in progress at a crash
        # Runs at close(), garbage collection or interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, self._state.shutdown)

    def __getstate__(self) -> dict:
        # workers belong to the process that started them: a copy gets its own pool, started on first use
        return {"num_workers": self.num_workers, "start_timeout_s": self.start_timeout_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        return self._state.executor is not None

    def start(self) -> list[int]:
        """Start the workers (if needed) and wait until every one has imported the verifier, so hard
        deadlines do not count start-up and a batch spreads over every worker. Returns the worker PIDs."""
        st = self._state
        if st.executor is not None and st.owner_pid != os.getpid():
            st.executor = st.slots = st.counter = None  # inherited through fork: the workers are not ours
        if st.executor is None:
            st.slots = self._ctx.Array("d", self.num_workers * worker.SLOT_WIDTH, lock=False)
            st.counter = self._ctx.Value("i", 0)
            st.owner_pid = os.getpid()
            with _main_script_hidden():
                self._start_workers(st)
        return self.worker_pids()

    def _start_workers(self, st: _PoolState) -> None:
        """Spawn the workers and wait until each has imported the verifier."""
        st.executor = ProcessPoolExecutor(
            max_workers=self.num_workers,
            mp_context=self._ctx,
            initializer=worker.init_worker,
            initargs=(st.slots, st.counter),
        )
        # Workers are spawned on demand: one submit per worker starts all of them.
        pings = [st.executor.submit(worker.ping) for _ in range(self.num_workers)]
        deadline = time.monotonic() + self.start_timeout_s
        while st.counter.value < self.num_workers:
            failed = next((f.exception() for f in pings if f.done() and f.exception()), None)
            if failed is not None:
                self._kill()
                raise RuntimeError(f"verifier workers failed to start: {failed}") from failed
            if time.monotonic() > deadline:
                self._kill()
                raise RuntimeError(
                    f"verifier workers did not start within {self.start_timeout_s:g} s "
                    f"({self.num_workers} spawned processes importing math-verify)"
                )
            time.sleep(0.01)
        wait(pings)

    def worker_pids(self) -> list[int]:
        slots = self._state.slots
        if slots is None:
            return []
        return [int(slots[i]) for i in range(0, len(slots), worker.SLOT_WIDTH) if slots[i]]

    def close(self) -> None:
        self._finalizer()

    def _kill(self) -> None:
        if self._state.executor is not None:
            self.restarts += 1
        self._state.kill()

    # ------------------------------------------------------------------ checking
    def run(
        self, items: list[tuple[int, str, str]], *, check_fn, timeout_s: float, kill_after_s: float, num_chunks: int
    ) -> dict[int, tuple[str, int, float]]:
        """Check ``(index, answer, gold)`` items; returns ``{index: (status, worker_pid, score)}``."""
        results: dict[int, tuple[str, int, float]] = {}
        pending = {item[0]: item for item in items}
        self._crashed = set()  # items in progress at a crash: checked again once
        stalled = 0  # consecutive rounds that resolved nothing (workers cannot even start)
        while pending and stalled < _MAX_STALLED_ROUNDS:
            before = len(pending)
            try:
                self._run_round(pending, results, check_fn, timeout_s, kill_after_s, num_chunks)
            except BaseException:
                self._kill()  # Ctrl-C or a bug: never leave a worker running a hung item
                raise
            stalled = stalled + 1 if len(pending) == before else 0
        if pending:
            log.error(
                "gave up on %d answers: %d verifier pool restarts in a row made no progress", len(pending), stalled
            )
        for index in pending:
            results[index] = ("error", 0, 0.0)
        return results

    def _run_round(self, pending, results, check_fn, timeout_s, kill_after_s, num_chunks) -> None:
        self.start()
        self._call_id += 1
        call_id = self._call_id
        ordered = [pending[i] for i in sorted(pending)]
        try:
            futures = {
                self._state.executor.submit(worker.run_chunk, call_id, chunk, check_fn, timeout_s)
                for chunk in _split(ordered, num_chunks)
            }
        except BrokenProcessPool:  # a worker died while idle (e.g. OOM killer): start afresh
            self._kill()
            return

        def harvest(done) -> bool:
            """Record finished chunks; True if the pool broke."""
            broken = False
            for fut in done:
                try:
                    pid, out = fut.result()
                except BrokenProcessPool:
                    broken = True
                    continue
                for index, status, score in out:
                    results[index] = (status, pid, score)
                    pending.pop(index, None)
            return broken

        while futures:
            done, futures = wait(futures, timeout=_POLL_S, return_when=FIRST_COMPLETED)
            broken = harvest(done)
            overrun = self._in_progress(call_id, older_than=kill_after_s)
            if not broken and not overrun:
                continue
            stuck = overrun or self._in_progress(call_id)
            harvest([f for f in futures if f.done()])
            self._kill()
            status = "timeout" if overrun else "error"
            for index, pid in stuck.items():
                if index in pending and (overrun or index in self._crashed):
                    results[index] = (status, pid, 0.0)
                    pending.pop(index)
                self._crashed.add(index)  # a first crash may be the machine's (memory): once more
            if overrun:
                log.warning(
                    "killed the verifier pool: %d answers ran past the %.1f s hard limit", len(overrun), kill_after_s
                )
            else:
                log.error("a verifier worker died; %d answers in progress marked 'error'", len(stuck))
            return

    def _in_progress(self, call_id: int, older_than: float = 0.0) -> dict[int, int]:
        """``{item_index: worker_pid}`` of items in progress that have spent more than ``older_than``
        s of their own time (CPU and sleep; :class:`_Charged`), or ran past the wall-clock backstop."""
        slots, now, found = self._state.slots, time.monotonic(), {}
        backstop = max(_BACKSTOP_MIN_S, _BACKSTOP_FACTOR * older_than)
        for base in range(0, len(slots), worker.SLOT_WIDTH):
            t0 = slots[base + 3]
            cid, index, pid = slots[base + 1], slots[base + 2], slots[base]
            if not (t0 and t0 == slots[base + 3] and cid == call_id):
                continue
            if older_than <= 0 or now - t0 > backstop or self._charged(int(pid), t0, now) > older_than:
                found[int(index)] = int(pid)
        return found


class _Charged:
    """An item's cost to its worker: CPU plus sleep time from ``/proc/<pid>/stat`` (not core waits), else wall time."""

    _TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

    def __init__(self):
        self._items: dict[tuple[int, float], list[float]] = {}  # (pid, start) -> [cpu0, asleep, last poll]

    def __call__(self, pid: int, started: float, now: float) -> float:
        stat = _proc_stat(pid)
        if stat is None:
            return now - started
        state, cpu = stat
        key = (pid, started)
        if key not in self._items:
            if len(self._items) > 1024:  # items long finished
                self._items.clear()
            self._items[key] = [cpu, 0.0, now]
        entry = self._items[key]
        if state in ("S", "T", "t"):  # asleep or stopped: waiting on something other than a core
            entry[1] += now - entry[2]
        entry[2] = now
        return (cpu - entry[0]) * self._TICK_S + entry[1]


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, user + system CPU ticks) of a process, or None where ``/proc`` cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


class _PoolState:
    """The executor and its shared arrays, separate from the pool so a finalizer can own it."""

    def __init__(self):
        self.executor = self.slots = self.counter = None
        self.owner_pid = os.getpid()

    def kill(self) -> None:
        """Kill every worker now (one may be stuck in C code) and reap them."""
        self._stop(graceful=False)

    def shutdown(self) -> None:
        """Let idle workers exit; kill any that do not within a few seconds."""
        self._stop(graceful=True)

    def _stop(self, graceful: bool) -> None:
        ex, self.executor = self.executor, None
        self.slots = self.counter = None
        if ex is None or os.getpid() != self.owner_pid:
            return  # a forked child (e.g. a DataLoader worker) must not touch its parent's workers
        procs = executor_processes(ex)  # no public way to kill workers before Python 3.14 (compat.stdlib)
        if graceful:
            ex.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if graceful:
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
            p.join()
        if not graceful:
            ex.shutdown(wait=True, cancel_futures=True)


def _split(items: list, num_chunks: int) -> list[list]:
    """At most ``num_chunks`` near-equal round-robin chunks: a group's (often pathological) answers run in parallel."""
    n = max(1, min(num_chunks, len(items)))
    return [items[i::n] for i in range(n)]
