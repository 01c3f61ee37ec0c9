"""The ``ngrpo`` command's entry point: OpenMP's spin and the allocator first, then the command.

It imports nothing heavy, so that a process that must restart on another C allocator
(:mod:`ngrpo_lightning.allocator`) does so before torch is loaded: the restart costs a
fraction of a second. ``host.allocator`` is read from the command line and the command's
default config file here; a value that only a config group sets is honoured later, once the
config is composed (the command then restarts after its imports).
"""

from __future__ import annotations

import os
import sys

from omegaconf import OmegaConf

from . import allocator
from .config import config_dir

COMMAND_CONFIGS = {"train": "config.yaml", "eval": "eval.yaml"}  # the commands that run models

# How long an idle OpenMP thread (torch's CPU kernels, GNU OpenMP) spins before it sleeps.
# libgomp's default, 300,000 spins, keeps a waiting thread on its core for up to a few
# milliseconds between kernels: on a quiet machine that is free, but when other processes
# want the cores it takes their time slices and the step slowed 7x beside two CPU-bound
# processes on 2 cores. 1,000 spins (what libgomp itself uses once its own threads outnumber
# the cores) cost nothing measurable on a quiet machine and gave 2.1x its quiet time there
# (docs/performance.md, "A busy machine"). Read when libgomp loads, so it is set here, before
# torch is imported; a value the user exported (or OMP_WAIT_POLICY) wins.
GOMP_SPINCOUNT = "1000"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    if argv[:1] and argv[0] in COMMAND_CONFIGS and allocator.LAUNCHED not in os.environ:
        try:
            wanted = allocator.resolve(allocator.requested(argv, default_allocator(COMMAND_CONFIGS[argv[0]])))
        except ValueError:  # the command reports it, naming the key, once the config is composed
            wanted = None
        if wanted is not None and wanted != allocator.active():
            allocator.restart_with(wanted, argv)
        os.environ[allocator.LAUNCHED] = wanted or allocator.active()
    from .cli import main as command  # only now: a restart above happens before torch loads

    return command(argv)


def default_allocator(config_file: str) -> str:
    """``host.allocator`` of a command's default config file (``auto`` when it has none)."""
    host = OmegaConf.load(config_dir() / config_file).get("host") or {}
    return host.get("allocator", "auto")


if __name__ == "__main__":
    sys.exit(main())
