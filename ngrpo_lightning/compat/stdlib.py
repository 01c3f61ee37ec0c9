"""Python standard library internals the package reads, tested on CPython 3.11.

The verifier pool kills its worker processes when a verifier hangs in C code; a ``ProcessPoolExecutor`` has no public
way to reach them before Python 3.14, so they are read from its process table (:func:`executor_processes`).
"""

from __future__ import annotations

import platform
from concurrent.futures import ProcessPoolExecutor

from ngrpo_lightning.compat import Library

TESTED = {"python": ">=3.11,<3.12"}
PYTHON = Library("python", TESTED, version=platform.python_version())
PYTHON.warn_if_untested()

__all__ = ["TESTED", "executor_processes"]


def executor_processes(executor: ProcessPoolExecutor) -> list:
    """The worker processes (``multiprocessing.Process``) ``executor`` has now; none once shut down."""
    return list((PYTHON.attribute(executor, "_processes") or {}).values())
