"""Freed memory handed back to the system between a training step's phases and, in a training forward, between the
decoder and the LM head (``release_freed_memory``).

glibc's malloc keeps freed pages resident, so one phase's short-lived tensors push the next phase's peak above what is
alive; ``malloc_trim(0)`` hands every whole free page back. The decoder's freed temporaries in a training forward are
such pages too: the LM head's [chunk, V] buffers and the backward's gradients do not fit in them. Under another
allocator (``make train`` preloads mimalloc) it is cheap and changes little.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _trim():
    """glibc's ``malloc_trim``, or ``None`` on another C library (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Hand the whole pages glibc's malloc holds free back to the system; whether it could."""
    trim = _trim()
    if trim is None:
        return False
    trim(0)
    return True
