"""The decoding step of a static-cache rollout, replayed from CUDA graphs, one per batch bucket.

On a GPU a decoding step of a small model is hundreds of small kernels, each launched from
Python: the launches, not the arithmetic, set its time. A CUDA graph records the step's kernels
once and replays them with one launch. Recording needs every shape and every address fixed: the
static KV cache (:mod:`.static_cache`) gives fixed buffers and a batch in buckets, and the step's
inputs are copied into buffers of the graph's own before each replay (the embeddings of the
sampled tokens, their positions, the attention mask as a boolean [b, 1, 1, width] tensor built
outside the graph, and where the step writes).

A graph is recorded the first time its bucket decodes (:attr:`DecodeGraphs.warmup_s` counts
the time), after two warm-up runs on a side stream; the warm-up writes the step's keys and
values where the replay writes them again, and the cache's positions are put back after it.

A graph reads the weights where they were when it was recorded. The engine keeps its graphs
from one rollout to the next (on the cache it keeps, :class:`~.static_cache.StaticCaches`) while
:meth:`DecodeGraphs.current` holds: every tensor the model reads during the rollout (its
parameters and buffers, and copies a backend makes for decoding such as LoRA's merged weights)
still has the address it had. Training updates weights in place, so they keep it; a copy made
anew may not, and then the graphs are recorded again.

``replay="rerun"`` runs the step on the same buffers instead of a graph: the CPU's check that
every input goes through them (``tests/test_static_decoding.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["DecodeGraphs"]


@dataclass
class _Recorded:
    inputs: dict[str, torch.Tensor]
    logits: torch.Tensor
    graph: object | None


class DecodeGraphs:
    """Replays ``model``'s decoding step on ``cache`` (a :func:`~.static_cache.rows_static_cache`)."""

    def __init__(self, model: torch.nn.Module, cache, replay: str = "cuda"):
        if replay not in ("cuda", "rerun"):
            raise ValueError(f"replay={replay!r}: allowed 'cuda' or 'rerun'")
        self.model, self.cache, self.replay = model, cache, replay
        self.addresses = tensor_addresses(model)
        self.recorded: dict[int, _Recorded] = {}
        self.pool = torch.cuda.graph_pool_handle() if replay == "cuda" else None
        self.warmup_s = 0.0

    def current(self, model: torch.nn.Module, cache) -> bool:
        """Whether these graphs still replay ``model`` on ``cache``: the same cache, and every tensor
        the model reads where it was when they were made."""
        return model is self.model and cache is self.cache and tensor_addresses(model) == self.addresses

    def __call__(self, inputs_embeds, position_ids, attention_mask, cache_position) -> torch.Tensor:
        """The step's last-position logits [b, V] (a buffer the next call overwrites)."""
        given = {
            "inputs_embeds": inputs_embeds,
            "position_ids": position_ids,
            "attention_mask": attention_mask,
            "cache_position": cache_position,
        }
        rows = inputs_embeds.shape[0]
        entry = self.recorded.get(rows)
        if entry is None:
            entry = self.recorded[rows] = self._record(given)
        for name, value in given.items():
            entry.inputs[name].copy_(value)
        if entry.graph is None:
            return self._forward(entry.inputs)
        entry.graph.replay()
        return entry.logits

    def _forward(self, inputs: dict) -> torch.Tensor:
        out = self.model(**inputs, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _record(self, given: dict) -> _Recorded:
        inputs = {name: value.clone() for name, value in given.items()}
        if self.replay == "rerun":
            return _Recorded(inputs, torch.empty(0), None)
        t0 = time.perf_counter()
        positions = [layer.cumulative_length.clone() for layer in self.cache.layers]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # kernels pick their algorithms, allocations settle
                self._forward(inputs)
                for layer, position in zip(self.cache.layers, positions):
                    layer.cumulative_length.copy_(position)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(inputs)
        torch.cuda.synchronize()
        self.warmup_s += time.perf_counter() - t0
        return _Recorded(inputs, logits, graph)


def tensor_addresses(model: torch.nn.Module) -> tuple:
    """Where every tensor ``model``'s forward reads lies: its parameters and buffers, and tensors a
    backend's layer holds for the pass (a merged copy), with their shapes and dtypes."""

    def held(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, tuple | list):
            for item in value:
                yield from held(item)

    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        for name, value in vars(module).items():
            if not name.startswith("_parameters") and not name.startswith("_buffers"):
                tensors.extend(held(value))
    return tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors)
