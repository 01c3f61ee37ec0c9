"""The ``ngrpo`` command's Python entry point, run by its launcher (``commands/bin/ngrpo``: it chose the allocator):
OpenMP's spin setting, then the command, then an exit without the garbage collector's last walk (:func:`program`).
It imports nothing heavy, so OpenMP's environment is set before torch loads it."""

from __future__ import annotations

import os
import sys

# How long an idle OpenMP thread spins before it sleeps. Too short, and waking threads for a step's many small parallel
# regions slows it on some machines (record floor-cpu-2026-12-07-5); too long, and a waiting thread takes other
# processes' time on a busy machine (-6). 30,000 is as fast as libgomp's 300,000 when quiet and faster when busy
# (docs/performance.md, "OpenMP's spin"). An exported value or OMP_WAIT_POLICY wins.
GOMP_SPINCOUNT = "30000"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    from ngrpo_lightning.commands.cli import main as command  # only now: OpenMP reads its settings when torch loads it

    return command(argv)


def program() -> None:
    """The ``ngrpo`` program (pyproject's script): :func:`main`, then :func:`~.cli.exit_after`."""
    code = main()
    from ngrpo_lightning.commands.cli import exit_after  # loaded by main already

    exit_after(code)


if __name__ == "__main__":
    program()
