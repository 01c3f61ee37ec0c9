"""Values worked out once per forward from a tensor every layer is handed, without writing on it.

transformers hands each decoder layer the same attention mask and rotary ``cos`` and ``sin``; what attention and the
fused rotation derive from them (an additive bias, where rows start, a signed ``sin``) is worked out by the first
layer. A :class:`TensorMemo` keeps those values by the tensor's identity without keeping it alive.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ngrpo_lightning.compat.torch import base_of

__all__ = ["TensorMemo"]


class TensorMemo:
    """``make()``'s value for a tensor and a key, made once while the tensor lives. While ``torch.compile`` traces,
    nothing is kept: its graph makes the value once."""

    def __init__(self):
        self.values = WeakIdKeyDictionary()  # tensor -> {key: value}

    def get(self, tensor: torch.Tensor, key: Hashable, make: Callable[[], object]):
        if torch.compiler.is_compiling():
            return make()
        kept = self.values.get(tensor)
        if kept is None:
            kept = self.values[tensor] = {}
        if key not in kept:
            value = make()
            if _holds(value, tensor):  # kept, it would keep its own key alive: made again instead
                return value
            kept[key] = value
        return kept[key]

    def __len__(self) -> int:
        return len(self.values)

    # a copy of a model (deepcopy, pickling) gets an empty memo of its own: the values belong to forwards under way
    def __deepcopy__(self, memo) -> TensorMemo:
        return TensorMemo()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


def _holds(value, tensor: torch.Tensor) -> bool:
    """Whether ``value`` is ``tensor`` or a view of it (an additive mask as its own bias, a slice)."""
    return isinstance(value, torch.Tensor) and (value is tensor or base_of(value) is tensor)
