"""A soft per-call time limit from SIGALRM (``setitimer``).

Soft because a signal handler only runs between Python bytecodes: a long C call (one huge
big-int multiplication) finishes before the limit takes effect. The verifier pool
(:mod:`.pool`) adds the hard limit on top by killing the worker process.

math-verify has its own ``signal.alarm`` timeouts; they must be disabled while this limit
is active (pass ``None``), because their ``alarm(0)`` on exit would cancel our timer.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class _Expired(BaseException):
    """Raised by the alarm handler. A BaseException so that the ``except Exception``
    blocks inside math-verify and sympy do not swallow it."""


@contextmanager
def soft_time_limit(seconds: float | None):
    """Raise ``TimeoutError`` in the body after ``seconds`` (None or <= 0: no limit).

    Main thread only (POSIX signals are delivered there).
    """
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

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            yield
        finally:
            try:
                armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            finally:
                signal.signal(signal.SIGALRM, previous)
    except _Expired:
        raise TimeoutError(f"answer check exceeded the {seconds:g} s limit") from None
