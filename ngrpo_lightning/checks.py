"""Value checks with errors that name the config key once, in full.

Pure Python (no torch, no Hydra), so every layer may import it. Components check hyper-parameters at construction: a
bad value is named by its full key before anything loads::

    check_number("train.ppo_epochs", 0, 1, integer=True)
    ValueError: train.ppo_epochs=0 is out of range: allowed [1, inf] (an integer)
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["check_bool", "check_choice", "check_number", "check_seed"]


def check_number(
    key: str,
    value,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    optional: bool = False,
):
    """Return ``value`` if it is a number (an ``int`` when ``integer``) within ``[low, high]``
    (open at ``low`` when ``low_open``, at ``high`` when ``high_open``); ``None`` passes when
    ``optional``. Otherwise raise ``ValueError`` naming ``key``, the value and what is allowed."""
    if value is None and optional:
        return None
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ValueError(f"{key}={value!r} must be {kind}" + (" (or null)" if optional else ""))
    bad = (low is not None and (value <= low if low_open else value < low)) or (
        high is not None and (value >= high if high_open else value > high)
    )
    if bad:
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        suffix = " (an integer)" if integer else ""
        interval = f"{'(' if low_open else '['}{lo}, {hi}{')' if high_open else ']'}"
        raise ValueError(f"{key}={value!r} is out of range: allowed {interval}{suffix}")
    return value


def check_seed(value) -> int:
    """``seed``: an integer in ``[0, 2**32 - 1]`` (outside it Lightning draws a random seed)."""
    return check_number("seed", value, 0, 2**32 - 1, integer=True)


def check_bool(key: str, value, error: type[ValueError] = ValueError) -> bool:
    """``value`` if it is ``true`` or ``false``; else raise ``error`` (a ``ValueError`` class) naming ``key`` and it."""
    if not isinstance(value, bool):
        raise error(f"{key}={value!r} must be true or false")
    return value


def check_choice(key: str, value, allowed: Iterable):
    """``value`` if it is one of ``allowed``; else raise ``ValueError`` naming ``key`` and the allowed values."""
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is unknown: allowed {sorted(allowed, key=str)}")
    return value
