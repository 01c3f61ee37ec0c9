"""A static KV cache whose rows can be compacted in place: a decoding step of fixed shapes a CUDA graph can replay.

transformers' ``StaticLayer`` keeps keys and values in buffers of the rollout's whole length, written in place at a
position held in a tensor, attended under a fixed-width mask: the step's shapes never change, as CUDA graphs (and
``torch.compile``) need. :class:`RowsStaticLayer` adds buffers for ``capacity`` rows allocated once (the first
``batch`` rows the decoding batch), :meth:`RowsStaticLayer.select_rows` moving the rows that go on to their front, and
one set of write positions for all layers (:class:`WritePositions`). The batch takes only :func:`batch_buckets`'
sizes, so a graph per bucket covers a rollout. An engine keeps its caches across rollouts (:class:`StaticCaches`), so a
graph is recorded once per run. Attention over the full-width buffer gives the growing cache's values up to float
rounding (``tests/test_static_decoding.py``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer

from ngrpo_lightning.backends.width_buckets import bucket_width
from ngrpo_lightning.compat.torch import mark_static_address

__all__ = ["RowsStaticLayer", "StaticCaches", "WritePositions", "batch_buckets", "rows_static_cache"]


def batch_buckets(rows: int) -> list[int]:
    """The batch sizes a static decoding batch takes: powers of two below ``rows``, and ``rows``."""
    out, size = [], 1
    while size < rows:
        out.append(size)
        size *= 2
    return [*out, rows]


class WritePositions:
    """Where a step writes, shared by a cache's layers: the first layer works the positions out and advances the one
    counter (``length``), the others take them as they are (fewer kernels per step than ``StaticLayer``)."""

    def __init__(self):
        self.length = torch.tensor(0, dtype=torch.long)  # positions written so far
        self.at: torch.Tensor | None = None  # the current step's, set by the first layer


class RowsStaticLayer(StaticLayer):
    """A ``StaticLayer`` over buffers of ``capacity`` rows; its ``keys`` and ``values`` are views of the first
    ``batch`` rows. ``positions``: its cache's :class:`WritePositions`, advanced where ``leads`` (the first layer)."""

    def __init__(self, max_cache_len: int, capacity: int, positions: WritePositions | None = None, leads: bool = True):
        super().__init__(max_cache_len)
        self.capacity = capacity
        self.positions, self.leads = positions or WritePositions(), leads
        self.cumulative_length = self.positions.length

    key_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' ``StaticLayer.update``, the write positions shared (:class:`WritePositions`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        shared = self.positions
        if self.leads:
            shared.at = torch.arange(key_states.shape[-2], device=self.device) + shared.length
            shared.length.add_(key_states.shape[-2])  # in place: the counter keeps its address
        self.keys.index_copy_(2, shared.at, key_states)
        self.values.index_copy_(2, shared.at, value_states)
        return self.keys, self.values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        rows = max(self.capacity, self.batch_size)
        shape = (rows, self.num_heads, self.max_cache_len)
        k_shape, v_shape = (*shape, self.k_head_dim), (*shape, self.v_head_dim)
        kept = self.key_buffer is not None and self.key_buffer.shape == k_shape and self.key_buffer.dtype == self.dtype
        if kept and self.key_buffer.device == self.device and self.value_buffer.shape == v_shape:
            self.key_buffer.zero_()  # a restarted cache: the same storage, nothing of the last rollout
            self.value_buffer.zero_()
        else:
            self.key_buffer = key_states.new_zeros(k_shape)
            self.value_buffer = value_states.new_zeros(v_shape)
        self._views(self.batch_size)
        shared = self.positions
        if shared.length.device != self.device:  # moved once, by the first layer: the others take it
            shared.length = shared.length.to(self.device)
        self.cumulative_length = shared.length
        if not torch.compiler.is_compiling():  # where the step writes: advanced in place by every step
            mark_static_address(self.cumulative_length)
        self.is_initialized = True

    def select_rows(self, rows: torch.Tensor) -> None:
        """The batch becomes ``rows`` of the current one, in that order (gathered first)."""
        if not self.is_initialized:
            return
        rows = torch.as_tensor(rows, device=self.device)
        count = len(rows)
        self.key_buffer[:count] = self.keys[rows]
        self.value_buffer[:count] = self.values[rows]
        self._views(count)
        self.batch_size = count

    def _views(self, count: int) -> None:
        """``keys`` and ``values``: the first ``count`` rows of the buffers, marked as keeping their address."""
        self.keys, self.values = self.key_buffer[:count], self.value_buffer[:count]
        if not torch.compiler.is_compiling():
            for t in (self.keys, self.values):
                mark_static_address(t)

    def restart(self) -> None:
        """Empty for the next rollout, keeping the buffers (and their addresses)."""
        self.is_initialized = False
        self.cumulative_length.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(indices)


def rows_static_cache(model, max_cache_len: int, capacity: int) -> Cache:
    """A cache of :class:`RowsStaticLayer` for every decoder layer of ``model``."""
    config = model.config.get_text_config(decoder=True)
    positions = WritePositions()
    return Cache(
        layers=[RowsStaticLayer(max_cache_len, capacity, positions, i == 0) for i in range(config.num_hidden_layers)]
    )


class StaticCaches:
    """An engine's static caches, kept across rollouts with the decoding graphs recorded on them (:attr:`graphs`): one
    per batch size, as long as the longest rollout so far rounded up to its
    :func:`~ngrpo_lightning.backends.width_buckets.bucket_width`; a rollout that fits restarts it, a longer one
    replaces it. Only the ``keep`` batch sizes used last are kept (default :data:`KEEP`: training and one other kind);
    a third costs the least recently used its cache and graphs, made again when next needed."""

    KEEP = 2

    def __init__(self, keep: int = KEEP):
        if keep < 1:
            raise ValueError(f"keep={keep}: at least one static cache must be kept")
        self.keep = keep
        self.kept: dict[int, Cache] = {}  # in order of use, the last used last
        self.graphs: dict[int, object] = {}  # the graphs recorded on kept[rows], set by the engine

    def get(self, model, length: int, rows: int) -> tuple[Cache, bool]:
        """A cache of at least ``length`` positions for ``rows`` rows, and whether it is the kept one."""
        cache = self.kept.pop(rows, None)
        if cache is not None and cache.layers[0].max_cache_len >= length:
            self.kept[rows] = cache  # the last used
            for layer in cache.layers:
                layer.restart()
            return cache, True
        self.graphs.pop(rows, None)  # recorded on the cache being replaced
        while len(self.kept) >= self.keep:  # the least recently used goes, with its graphs
            oldest = next(iter(self.kept))
            del self.kept[oldest]
            self.graphs.pop(oldest, None)
        length = bucket_width(length)
        self.kept[rows] = cache = rows_static_cache(model, length, rows)
        return cache, False
