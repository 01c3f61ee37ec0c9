"""A soft per-call limit on the CPU time a check spends, from SIGPROF (``setitimer(ITIMER_PROF)``).

CPU time, not wall time: on a busy machine (a sweep beside an eval, a test suite beside a run) a
check waits for a core, and that wait is no fault of the check; counted in wall time, a check of
a few milliseconds ran past a 2 s limit there. A check that computes too long still stops.

Soft because a signal handler only runs between Python bytecodes: a long C call (one huge
big-int multiplication) finishes before the limit takes effect. The verifier pool
(:mod:`.pool`) adds the hard limit on top by killing the worker process.

math-verify has its own ``signal.alarm`` timeouts (wall time, SIGALRM); they are disabled
here (pass ``None``): they work in the main thread only and count the machine's load.
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
    """Raise ``TimeoutError`` in the body once it has used ``seconds`` of this process's CPU time
    (None or <= 0: no limit).

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
