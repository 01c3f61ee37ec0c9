"""A soft per-call limit on the CPU time a check spends, from SIGPROF (``setitimer(ITIMER_PROF)``).

CPU time, not wall time: on a busy machine a check waits for a core, no fault of the check. Soft because a signal
handler runs only between bytecodes, so a long C call finishes first; the verifier pool (:mod:`.pool`) adds the hard
limit by killing the worker. math-verify's own ``signal.alarm`` timeouts (wall time, main thread only) are disabled."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class _Expired(BaseException):
    """Raised by the alarm handler; a BaseException, so math-verify's and sympy's ``except Exception`` miss it."""


@contextmanager
def soft_time_limit(seconds: float | None):
    """Raise ``TimeoutError`` in the body after ``seconds`` of process CPU time (None, <= 0: none); main thread only."""
    if seconds is None or seconds <= 0:
        yield
        return
    if not hasattr(signal, "setitimer"):
        raise RuntimeError("soft_time_limit needs signal.setitimer (POSIX); pass timeout_s=None on this platform")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "soft_time_limit only works in the main thread; pass timeout_s=None and "
            "enforce the limit from outside (MathReward does, with worker processes)"
        )
    armed = True

    def on_alarm(signum, frame):
        nonlocal armed
        if armed:  # a late alarm after the body finished must not raise
            armed = False
            raise _Expired

    previous = signal.signal(signal.SIGPROF, on_alarm)
    try:
        try:
            signal.setitimer(signal.ITIMER_PROF, seconds)
            yield
        finally:
            try:
                armed = False
                signal.setitimer(signal.ITIMER_PROF, 0)
            finally:
                signal.signal(signal.SIGPROF, previous)
    except _Expired:
        raise TimeoutError(f"answer check used more than its {seconds:g} s of CPU time") from None
