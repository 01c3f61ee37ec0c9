"""How many threads a process of a run computes on: set once, the same way however it was launched.

The thread count changes a CPU's results (sums in another order) and each launcher has its own default, so one rule
decides, before anything is built or measured:

1. ``backend.threads`` when set;
2. else ``OMP_NUM_THREADS`` when the user set it (torchrun's own default of 1 is not the user's);
3. else the cores this process may run on, shared by the run's processes on this host.

The run's processes on this host: all of them where the rendezvous address is loopback, else the launcher's processes
per node (torchrun's ``LOCAL_WORLD_SIZE``, or Lightning's per node). Outside torchrun its variables are not read.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

import torch

__all__ = ["ProcessThreads", "decide_threads", "set_process_threads"]


@dataclass(frozen=True)
class ProcessThreads:
    """The threads of this process, and why (for the run's header and its records)."""

    threads: int
    reason: str  # "backend.threads", "OMP_NUM_THREADS" or "cores / processes"
    cores: int
    processes_on_host: int

    def describe(self) -> str:
        if self.reason == "cores / processes":
            share = f"{self.cores} cores" + (
                f" / {self.processes_on_host} processes on this host" if self.processes_on_host > 1 else ""
            )
            return f"{self.threads} thread{'s' if self.threads != 1 else ''} ({share})"
        return f"{self.threads} thread{'s' if self.threads != 1 else ''} ({self.reason})"


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a scheduler or taskset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def processes_on_host(processes_per_node: int, env: dict | None = None) -> int:
    """The run's processes on this host (see the module docstring); the launcher's variables are read only under
    torchrun (``TORCHELASTIC_RUN_ID``)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env:
        return max(1, processes_per_node)
    world = int(env.get("WORLD_SIZE", 0) or 0)
    if world > 1 and _is_loopback(env.get("MASTER_ADDR", "")):
        return world
    local = int(env.get("LOCAL_WORLD_SIZE", 0) or 0)  # torchrun, per node
    return max(1, local or processes_per_node)


def _is_loopback(address: str) -> bool:
    if address in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def user_threads(env: dict | None = None) -> int | None:
    """``OMP_NUM_THREADS`` as the user set it; None where unset or torchrun's own default (1, for several processes)."""
    env = os.environ if env is None else env
    value = env.get("OMP_NUM_THREADS", "").strip()
    if not value.isdigit() or int(value) < 1:
        return None
    launched_by_torchrun = "TORCHELASTIC_RUN_ID" in env and int(env.get("LOCAL_WORLD_SIZE", 1) or 1) > 1
    if launched_by_torchrun and value == "1":  # to run on one thread there, set backend.threads=1
        return None
    return int(value)


def decide_threads(setting: int | None, processes_per_node: int, env: dict | None = None) -> ProcessThreads:
    """The rule of the module docstring, without changing anything."""
    cores, on_host = available_cores(), processes_on_host(processes_per_node, env)
    if setting is not None:
        if int(setting) < 1:
            raise ValueError(f"backend.threads must be >= 1 (or null: decided per process), got {setting!r}")
        return ProcessThreads(int(setting), "backend.threads", cores, on_host)
    given = user_threads(env)
    if given is not None:
        return ProcessThreads(given, "OMP_NUM_THREADS", cores, on_host)
    return ProcessThreads(max(1, cores // on_host), "cores / processes", cores, on_host)


def set_process_threads(setting: int | None, processes_per_node: int) -> ProcessThreads:
    """Decide this process's threads and set them: torch's, and ``OMP_NUM_THREADS`` for what it starts."""
    decided = decide_threads(setting, processes_per_node)
    torch.set_num_threads(decided.threads)
    os.environ["OMP_NUM_THREADS"] = str(decided.threads)
    return decided
