"""Freed host memory stays in the process, for the next step to reuse (glibc's malloc).

PyTorch's CPU tensors come from the C allocator. glibc serves every allocation above its
mmap threshold (32 MiB at most) with a fresh ``mmap`` and gives it back to the OS when the
tensor is freed, and trims the heap's free top the same way. A training step allocates the
same large tensors every time (the LM head's logits chunks, the MLP activations, the
embedding and head gradients), so each step touches fresh pages again: a page fault per
4 KiB, paid on every write to a new tensor. Zeroing the 113 MB embedding gradient of the
packaged model took 150 ms that way, at 0.75 GB/s.

:func:`keep_freed_memory` turns both returns off (``M_MMAP_MAX = 0``: large blocks come from
the heap too; ``M_TRIM_THRESHOLD`` at its maximum, 2 GiB: the heap's free top is kept). Freed
blocks are then reused without faults. The process's peak memory is unchanged (the same
tensors are alive at the peak); its memory after the peak is not given back until it exits.
``host.keep_freed_memory: true`` (the default) applies it when a run or evaluation starts;
elsewhere than glibc (macOS, musl) it does nothing.

Under mimalloc (``host.allocator``, :mod:`ngrpo_lightning.allocator`) the same setting turns
its purging off (``mi_option_purge_delay = -1``): by default mimalloc returns freed pages to
the OS after a second, and every step then faults them in again (the default run measured
11.9-12.2 s per step instead of 10.2-10.5; 4.0 GiB instead of 4.2 at its peak).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
INT_MAX = 2**31 - 1
MI_OPTION_PURGE_DELAY = 15  # mimalloc's mi_option_t number (mimalloc.h, stable since 2.1 as reset_delay)


def keep_freed_memory() -> bool:
    """Tell the C allocator to keep freed memory for reuse (glibc's malloc, or mimalloc when it is
    preloaded); ``True`` if it took the settings."""
    process = ctypes.CDLL(None)
    if hasattr(process, "mi_option_set"):  # mimalloc replaced malloc: glibc's settings would tune nothing
        process.mi_option_set.argtypes, process.mi_option_get.restype = [ctypes.c_int, ctypes.c_long], ctypes.c_long
        process.mi_option_get.argtypes = [ctypes.c_int]
        process.mi_option_set(MI_OPTION_PURGE_DELAY, -1)
        return process.mi_option_get(MI_OPTION_PURGE_DELAY) == -1
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        log.debug("no glibc mallopt: host memory settings left as they are")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, INT_MAX))


def wants_freed_memory_kept(cfg) -> bool:
    """``host.keep_freed_memory`` of a run's config (default true), checked."""
    keep = (cfg.get("host") or {}).get("keep_freed_memory", True)
    if not isinstance(keep, bool):
        raise ValueError(f"host.keep_freed_memory={keep!r} must be true or false")
    return keep


def apply_host_settings(cfg) -> None:
    """Apply the run's ``host.*`` settings to this process (once a run starts)."""
    if wants_freed_memory_kept(cfg):
        keep_freed_memory()
