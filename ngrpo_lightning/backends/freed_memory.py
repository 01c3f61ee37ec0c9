"""Freed memory handed back to the system before a training step's update and, in a training forward, between the
decoder and the LM head (``release_freed_memory``): the update makes the step's peak.

glibc's malloc keeps freed pages resident, so earlier short-lived tensors push the update's peak above what is alive;
``malloc_trim(0)`` hands every whole free page back, the decoder's freed temporaries too (the LM head's [chunk, V]
buffers and the backward's gradients do not fit in them). Not before the frozen passes: they reuse the rollout's
pages. Under mimalloc (the ``ngrpo`` command's allocator) it is cheap and changes little."""

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
    if trim is not None:
        trim(0)
    return trim is not None
