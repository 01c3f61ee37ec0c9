"""A KV cache whose layers write each decoding step in place.

transformers' ``DynamicCache`` grows by concatenation, copying O(L^2) entries over a rollout of L tokens.
:func:`reserved_cache` gives a ``Cache`` of :class:`ReservedLayer`: each layer reserves room for the whole rollout at
its first update and writes later positions into it; the model reads views of the filled part (``DynamicCache``'s
values). ``store_dtype`` (the backend's: float32 for a half model decoding on CPU with ``sdpa_gqa``,
:mod:`ngrpo_lightning.backends.attention`) keeps keys and values wider, widened once when written (bfloat16 is exact
in float32); the prefill reads them as the model made them.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers.cache_utils import Cache, DynamicLayer


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` backed by buffers of ``capacity`` positions (doubled if outgrown). ``read_width``
    (:meth:`~ngrpo_lightning.backends.base.Backend.kv_read_width`): a decoding step reads the first
    ``read_width(length)`` positions, the unwritten ones zero; the cache's length stays the filled part's."""

    def __init__(self, capacity: int, store_dtype: torch.dtype | None = None, read_width=None):
        super().__init__()
        self.capacity, self.length, self.store_dtype, self.read_width = capacity, 0, store_dtype, read_width
        self.key_buffer = self.value_buffer = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self.key_buffer is None or self.length + new > self.key_buffer.shape[-2]:
            self._resize(
                torch.arange(key_states.shape[0], device=key_states.device),
                max(self.capacity, 2 * (self.length + new)),
                key_states,
                value_states,
            )
        first, end = self.length == 0, self.length + new
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        views = self._views()
        return (key_states, value_states) if first else views

    def _resize(self, rows: torch.Tensor, capacity: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New buffers of ``capacity`` positions holding the filled part of ``rows``."""
        old_keys, old_values = self.key_buffer, self.value_buffer
        dtype = self.store_dtype or keys.dtype
        new = keys.new_empty if self.read_width is None else keys.new_zeros  # read past the length: finite
        if self.read_width is not None:
            capacity = self.read_width(capacity)
        self.key_buffer = new(len(rows), keys.shape[1], capacity, keys.shape[-1], dtype=dtype)
        self.value_buffer = new(len(rows), values.shape[1], capacity, values.shape[-1], dtype=dtype)
        if old_keys is not None and self.length:
            self.key_buffer[:, :, : self.length] = old_keys[rows, :, : self.length]
            self.value_buffer[:, :, : self.length] = old_values[rows, :, : self.length]

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.length if self.read_width is None else self.read_width(self.length)
        self.keys = self.key_buffer[:, :, :width]
        self.values = self.value_buffer[:, :, :width]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def _select_rows(self, rows: torch.Tensor) -> None:
        if self.key_buffer is not None:
            rows = rows.to(self.key_buffer.device)
            self._resize(rows, self.key_buffer.shape[-2], self.key_buffer, self.value_buffer)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(torch.as_tensor(indices))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.key_buffer is not None:
            self._select_rows(torch.arange(self.key_buffer.shape[0]).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """``DynamicLayer.crop``: a negative count drops that many last positions; a positive one
        (transformers' deprecated form) is the length to keep."""
        if self.key_buffer is not None and tokens_to_remove:
            keep = tokens_to_remove if tokens_to_remove > 0 else self.length + tokens_to_remove
            self.length = max(0, min(self.length, keep))
            self._views()

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        self.length = 0
        super().reset()


def reserved_cache(capacity: int, store_dtype: torch.dtype | None = None, read_width=None) -> Cache:
    """A cache whose layers reserve ``capacity`` positions (prompt + new tokens) each, kept in ``store_dtype``
    (default: the model's), read at ``read_width`` of their length (default: the length)."""
    return Cache(layer_class_to_replicate=partial(ReservedLayer, capacity, store_dtype, read_width))
