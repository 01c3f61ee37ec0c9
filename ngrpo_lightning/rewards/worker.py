"""Code that runs inside the verifier worker processes (see :mod:`.pool`); free of torch.

Progress protocol: each worker owns one 4-float slot of a shared array, ``[pid, call_id,
item_index, start_time]``, written before every item, so the parent sees which item a worker is on
and since when (``time.monotonic`` is system-wide on Linux) and kills it past the hard limit."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import threading
import time

from ngrpo_lightning.rewards.limits import soft_time_limit
from ngrpo_lightning.rewards.verify import verify_answer

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
SLOT_WIDTH = 4
_slots = None  # shared multiprocessing RawArray('d'), set by init_worker
_slot = -1


def init_worker(slots, counter) -> None:
    """Pool initializer: die with the parent; claim a progress slot; leave Ctrl-C to the parent."""
    global _slots, _slot
    die_with_parent()
    # Ctrl-C goes to the whole process group; the parent handles it and kills the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with counter.get_lock():  # the parent reads the count under this lock: it sees the PID with it
        slot = counter.value
        if (slot + 1) * SLOT_WIDTH <= len(slots):
            _slots, _slot = slots, slot
            _slots[slot * SLOT_WIDTH] = os.getpid()
        counter.value += 1


def die_with_parent() -> None:
    """A worker must not outlive a trainer killed outright: on Linux the kernel sends it SIGKILL when its parent dies
    (``prctl(PR_SET_PDEATHSIG)``), even in C code; elsewhere a daemon thread exits once the parent is gone."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) == 0:
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)
            return
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-death-watch", daemon=True).start()


def ping() -> int:
    return os.getpid()


def run_chunk(
    call_id: int, items: list[tuple[int, str, str]], check_fn, timeout_s: float
) -> tuple[int, list[tuple[int, str, float]]]:
    """Check ``(index, answer, gold)`` items; returns ``(pid, [(index, status, score), ...])``.
    ``check_fn.prepare(answer, gold)``, if present, runs outside every time limit (an import cut off midway by a limit
    would leave a half-made module that breaks every later check)."""
    out = []
    prepare = getattr(check_fn or verify_answer, "prepare", None)
    for index, answer, gold in items:
        if prepare is not None:
            _mark(call_id, index, idle=True)  # no start time yet: the parent's limits do not run
            prepare(answer, gold)
        _mark(call_id, index)
        out.append((index, *check_one(answer, gold, check_fn, timeout_s)))
    _mark(0, -1, idle=True)
    return os.getpid(), out


def check_one(answer: str, gold: str, check_fn, timeout_s: float) -> tuple[str, float]:
    """(status, score) of one answer: ``correct`` / ``wrong`` / ``timeout`` (soft limit) /
    ``error``. A checker returns a bool or a graded score in [0, 1] (``correct`` at 1)."""
    try:
        with soft_time_limit(timeout_s):
            score = float((check_fn or verify_answer)(answer, gold))
    except TimeoutError:
        return "timeout", 0.0
    except Exception:  # a verifier bug must not take the training step down
        return "error", 0.0
    if not score < 1.0:  # NaN scores nothing below; full marks are exactly 1
        return ("correct", 1.0) if score >= 1.0 else ("wrong", 0.0)
    # A near miss stays below 1 in the float32 rewards too (0.99999999 would round to 1.0).
    return "wrong", min(max(score, 0.0), 0.9999)


def _mark(call_id: int, index: int, idle: bool = False) -> None:
    if _slots is None:
        return
    base = _slot * SLOT_WIDTH
    # Zero the start time first so the parent never pairs a new index with an old time.
    _slots[base + 3] = 0.0
    _slots[base + 1] = call_id
    _slots[base + 2] = index
    if not idle:
        _slots[base + 3] = time.monotonic()
