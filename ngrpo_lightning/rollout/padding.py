"""Padding, in one place: prompts left-padded, responses right-padded (``[prompt | response]`` per row)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["pad_rows", "pad_to"]


def pad_to(t: torch.Tensor, width: int, value: float = 0, left: bool = False) -> torch.Tensor:
    """``t`` ([..., w], w <= ``width``) padded with ``value`` on the right (or ``left``) to ``width``."""
    missing = width - t.shape[-1]
    if missing <= 0:
        return t
    return torch.nn.functional.pad(t, (missing, 0) if left else (0, missing), value=value)


def pad_rows(
    rows: Sequence[Sequence | torch.Tensor],
    value: float = 0,
    left: bool = False,
    width: int | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths as one ``[N, width]`` tensor (``width``: the longest row unless given) padded with
    ``value`` on the right (or ``left``), and its long mask of real entries. Lists of ints become long tensors."""
    tensors = [r if isinstance(r, torch.Tensor) else torch.as_tensor(list(r), dtype=torch.long) for r in rows]
    dtype = dtype or (tensors[0].dtype if tensors else torch.long)
    width = max([len(t) for t in tensors] + [0]) if width is None else width
    out = torch.full((len(tensors), width), value, dtype=dtype)
    mask = torch.zeros((len(tensors), width), dtype=torch.long)
    for i, t in enumerate(tensors):
        n = len(t)
        if n:
            cols = slice(width - n, width) if left else slice(0, n)
            out[i, cols], mask[i, cols] = t.to(dtype), 1
    return out, mask
