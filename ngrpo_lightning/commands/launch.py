"""The ``ngrpo`` command's entry point: OpenMP's spin setting, then the command, then an exit
without the garbage collector's last walk (:func:`program`).

It imports nothing heavy, so that the environment OpenMP reads when torch loads it is set
first. Nothing here restarts the process or changes its allocator: a smaller peak on mimalloc
is the launcher's business (``make train`` preloads it; docs/performance.md, "The allocator").
"""

from __future__ import annotations

import os
import sys

# How long an idle OpenMP thread (torch's CPU kernels, GNU OpenMP) spins before it sleeps.
# libgomp's default, 300,000 spins, keeps a waiting thread on its core for up to a few
# milliseconds between kernels: on a quiet machine that is free, but when other processes
# want the cores it takes their time slices and the step slows several times over. 1,000 spins
# (what libgomp itself uses once its own threads outnumber the cores) cost nothing measurable on
# a quiet machine and win most of the loss back on a busy one (docs/performance.md, "A busy
# machine"). Read when libgomp loads, so it is set here, before torch is imported; a value the
# user exported (or OMP_WAIT_POLICY) wins.
GOMP_SPINCOUNT = "1000"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    from ngrpo_lightning.commands.cli import main as command  # only now: OpenMP reads its settings when torch loads it

    return command(argv)


def program() -> None:
    """The ``ngrpo`` program (pyproject's script): :func:`main`, then the process ends without the
    garbage collector's last walk over every object (:func:`~ngrpo_lightning.commands.cli.exit_after`)."""
    code = main()
    from ngrpo_lightning.commands.cli import exit_after  # loaded by main already

    exit_after(code)


if __name__ == "__main__":
    program()
