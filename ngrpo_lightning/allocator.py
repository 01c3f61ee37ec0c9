"""The process's C allocator: mimalloc, preloaded when the ``ngrpo`` command starts.

Why. A CPU training step allocates and frees the same large tensors every step (the MLP's
activations, the LM head's logits chunks, the gradients). glibc's malloc, told to keep freed
blocks for speed (:mod:`ngrpo_lightning.host_memory`), leaves holes between the blocks that
stay alive, and the process's peak ends up 0.2-0.4 GiB above what is alive at it. mimalloc
(Microsoft's allocator, installed from PyPI as ``cmeel-mimalloc``) packs the same tensors
tighter: the default run peaks at 4.16-4.18 GiB instead of 4.38-4.55, at the same time per
step (docs/performance.md, "The allocator's share of the peak").

How. A library that replaces ``malloc`` must be in the process before its first allocation:
``LD_PRELOAD`` when the process starts. The ``ngrpo`` command therefore starts in
:func:`ngrpo_lightning.launch.main`, which imports nothing heavy; when ``host.allocator`` asks
for an allocator the process does not have, it replaces itself (``exec``: the same process id,
the same arguments) with the library preloaded. Child processes (answer-checking workers, a
multi-process launcher's ranks) inherit it. Values and gradients do not depend on the
allocator. ``host.allocator``: ``auto`` (mimalloc where it is installed, on Linux; else the
system's), ``mimalloc``, or ``system`` (the C library's own malloc).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import sys
from pathlib import Path

ALLOCATORS = ("auto", "mimalloc", "system")
# Set by the command for the process it starts, so that a second exec is never attempted.
LAUNCHED = "NGRPO_ALLOCATOR"


def mimalloc_path() -> Path | None:
    """The installed mimalloc shared library (the ``cmeel-mimalloc`` wheel), Linux only."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        files = importlib.metadata.files("cmeel-mimalloc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.startswith("libmimalloc.so."):
            path = Path(file.locate())
            if path.exists():
                return path
    return None


def configured(cfg) -> str:
    """``host.allocator`` of a run's config as given (default ``auto``); :func:`resolve` checks it."""
    return (cfg.get("host") or {}).get("allocator", "auto")


def resolve(name) -> str:
    """``mimalloc`` or ``system``: what ``host.allocator=name`` means on this machine."""
    if name not in ALLOCATORS:
        raise ValueError(f"host.allocator={name!r}: expected one of {', '.join(ALLOCATORS)}")
    if name == "auto":
        return "mimalloc" if mimalloc_path() is not None else "system"
    if name == "mimalloc" and mimalloc_path() is None:
        raise ValueError(
            "host.allocator=mimalloc: the mimalloc library is not installed (pip install cmeel-mimalloc; Linux only)"
        )
    return name


def active() -> str:
    """The allocator this process runs on: ``mimalloc`` when its symbols are loaded, else ``system``."""
    return "mimalloc" if hasattr(ctypes.CDLL(None), "mi_version") else "system"


def preload_env(name: str, environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with ``LD_PRELOAD`` holding mimalloc (``name='mimalloc'``) or not (``'system'``)."""
    kept = [p for p in environ.get("LD_PRELOAD", "").split(":") if p and "libmimalloc" not in Path(p).name]
    if name == "mimalloc":
        kept.insert(0, str(mimalloc_path()))
    env = {k: v for k, v in environ.items() if k != "LD_PRELOAD"}
    if kept:
        env["LD_PRELOAD"] = ":".join(kept)
    env[LAUNCHED] = name
    return env


def restart_with(name: str, argv: list[str]) -> None:
    """Replace this process by ``ngrpo <argv>`` running on allocator ``name`` (does not return)."""
    sys.stdout.flush()
    sys.stderr.flush()
    command = [sys.executable, "-m", "ngrpo_lightning.launch", *argv]
    os.execve(sys.executable, command, preload_env(name, dict(os.environ)))


def requested(argv: list[str], default) -> str:
    """``host.allocator`` as the command line sets it (the last ``host.allocator=`` wins), else ``default``."""
    value = default
    for arg in argv:
        if arg.startswith(("host.allocator=", "++host.allocator=", "+host.allocator=")):
            value = arg.split("=", 1)[1]
    return value


def ensure(wanted, argv: list[str]) -> None:
    """Restart the ``ngrpo`` command on allocator ``wanted`` unless it already runs on it.

    Only a process the command started restarts (``NGRPO_ALLOCATOR`` set, to the allocator
    it then asked for); a script or test calling the Python API keeps its own allocator. An
    unknown value raises ``ValueError`` naming the key."""
    name = resolve(wanted)
    launched = os.environ.get(LAUNCHED)
    if launched is None or name == active():
        return
    if launched == name:  # asked for once already and not loaded: never loop
        print(f"warning: host.allocator={wanted}: {name} could not be preloaded; running on {active()}")
        return
    restart_with(name, argv)
