"""The decoding step of a static-cache rollout, replayed from CUDA graphs, one per batch bucket.

A small model's GPU decoding step is hundreds of small kernels whose launches set its time; a CUDA graph replays them
with one launch. Recording needs every shape and address fixed: the static KV cache (:mod:`.static_cache`) gives fixed
buffers and a batch in buckets, and the step's inputs are copied into the graph's own buffers before each replay.
This records the model's step only, for explorers that are not ``capturable`` (the whole step:
:class:`~.step_graphs.StepGraphs`). A graph is recorded the first time its bucket decodes
(:attr:`DecodeGraphs.warmup_s`), after two warm-up runs on a side stream, the cache's positions put back after them.
It reads the weights where they were when recorded: the engine keeps its graphs across rollouts while
:meth:`DecodeGraphs.current` holds (every tensor the model reads still at its address; training updates weights in
place), else records them again. ``replay="compile"`` hands the step to ``torch.compile`` (``mode="reduce-overhead"``
on a GPU; on a CPU without graphs, the check of the path), to measure both ways (``benchmarks/harness.py decoding``).
``replay="rerun"`` runs the step on the same buffers instead of a graph: the CPU's check that every input goes
through them (``tests/test_static_decoding.py``).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import torch

from ngrpo_lightning.backends.swap import original_class
from ngrpo_lightning.backends.width_buckets import additive_mask
from ngrpo_lightning.compat.torch import own_buffers, own_parameters
from ngrpo_lightning.models.walks import modules_of

__all__ = ["REPLAYS", "DecodeGraphs"]

REPLAYS = ("cuda", "compile", "rerun")


@dataclass
class _Recorded:
    inputs: dict[str, torch.Tensor]
    logits: torch.Tensor
    graph: object | None


class DecodeGraphs:
    """Replays ``model``'s decoding step on ``cache`` (a :func:`~.static_cache.rows_static_cache`)."""

    def __init__(self, model: torch.nn.Module, cache, replay: str = "cuda"):
        if replay not in REPLAYS:
            raise ValueError(f"replay={replay!r}: allowed {', '.join(map(repr, REPLAYS))}")
        if replay == "compile" and any(getattr(m, "pack_once", False) for m in model.modules()):
            raise ValueError(
                "graphs='compile' cannot compile the CPU backend's packed (oneDNN) products: "
                "decode with backend.disable=[packed_products], or without compilation"
            )
        self.model, self.cache, self.replay = model, cache, replay
        self.addresses = tensor_addresses(model)
        self.recorded: dict[int, _Recorded] = {}
        self.pool = torch.cuda.graph_pool_handle() if replay == "cuda" else None
        self.warmup_s = 0.0
        self.compiled = None  # replay="compile": the compiled step, made at the first call

    def current(self, model: torch.nn.Module, cache) -> bool:
        """Whether these graphs still replay ``model`` on ``cache``: the same cache, every tensor where it was."""
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
        if self.replay == "compile":
            return self._compiled_call(entry.inputs)
        if entry.graph is None:
            return self._forward(entry.inputs)
        entry.graph.replay()
        return entry.logits

    def _forward(self, inputs: dict) -> torch.Tensor:
        return decode_step(self.model, self.cache, inputs)

    def _compiled_call(self, inputs: dict) -> torch.Tensor:
        """The compiled step on ``inputs`` (its output, on a GPU, is overwritten by the next call)."""
        device_type = inputs["inputs_embeds"].device.type
        if self.compiled is None:
            self.compiled = compiled_step(device_type)
        if device_type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # each call a new step: the last one's outputs are read
        return self.compiled(self.model, self.cache, inputs)

    def _record(self, given: dict) -> _Recorded:
        inputs = {name: value.clone() for name, value in given.items()}
        if self.replay == "rerun":
            return _Recorded(inputs, torch.empty(0), None)
        if self.replay == "compile":  # compiled (and, on a GPU, recorded) by its first calls
            t0 = time.perf_counter()
            self._warm_up(lambda: self._compiled_call(inputs))
            self.warmup_s += time.perf_counter() - t0
            return _Recorded(inputs, torch.empty(0), None)
        step = lambda: self._forward(inputs)  # noqa: E731
        return self._capture(step, step, inputs=inputs)

    def _capture(self, warm, step, generator=None, inputs=None, way_out: str = "") -> _Recorded:
        """Record ``step`` as a CUDA graph after two runs of ``warm`` on a side stream (counted in :attr:`warmup_s`);
        ``generator``: one the step draws from, registered so each replay draws the next numbers; ``way_out``: what
        the error of a step that cannot be recorded suggests first."""
        t0 = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # kernels pick their algorithms, allocations settle
            self._warm_up(warm)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if generator is not None and generator.device.type == "cuda":
            graph.register_generator_state(generator)
        try:
            # thread_local: a rollouts-ahead worker records while the training thread keeps computing
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits = step()
        except RuntimeError as err:  # a model whose step reads the host or changes shape cannot be recorded
            raise RuntimeError(
                f"recording the decoding step of {type(self.model).__name__} as a CUDA graph failed ({err}); "
                f"{way_out}decode without graphs with backend.disable=[decode_graphs]"
            ) from err
        torch.cuda.synchronize()
        self.warmup_s += time.perf_counter() - t0
        return _Recorded(inputs or {}, logits, graph)

    def _warm_up(self, step) -> None:
        """Run ``step`` twice, the cache's positions put back after each (the step that follows rewrites the same)."""
        positions = [layer.cumulative_length.clone() for layer in self.cache.layers]
        for _ in range(2):
            step()
            for layer, position in zip(self.cache.layers, positions):
                layer.cumulative_length.copy_(position)
        if self.cache.layers[0].cumulative_length.is_cuda:
            torch.cuda.synchronize()


def decode_step(model: torch.nn.Module, cache, inputs: dict) -> torch.Tensor:
    """One decoding step on a static cache: the last position's logits [b, V]. A boolean mask becomes additive once
    per step, not in every layer as PyTorch's GPU attention would (the same values)."""
    mask = inputs["attention_mask"]
    if mask.dtype == torch.bool:  # PyTorch's own conversion: 0 where read, -inf where not
        inputs = {**inputs, "attention_mask": additive_mask(mask, inputs["inputs_embeds"].dtype)}
    out = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def compiled_step(device_type: str):
    """:func:`decode_step` for ``torch.compile`` (replayed from CUDA graphs on a GPU); compiled once, it serves every
    engine and bucket."""
    return torch.compile(decode_step, mode="reduce-overhead" if device_type == "cuda" else None)


_SEQUENCES = (tuple, list)
_HOLDERS = (torch.Tensor, *_SEQUENCES)
_HOLD_NO_TENSOR = frozenset({bool, int, float, str, type(None), dict, collections.OrderedDict, set})


def tensor_addresses(model: torch.nn.Module) -> tuple:
    """Where every tensor ``model``'s forward reads lies, with shapes and dtypes: parameters, buffers, and tensors a
    swapped layer (:mod:`ngrpo_lightning.backends.swap`; only their attributes are looked through) holds for the pass,
    less its ``not_read_in_rollouts`` (training caches, or every rollout would record again)."""

    def held(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, _SEQUENCES):
            for item in value:
                yield from held(item)

    tensors = []  # with the None of unset parameters and buffers, dropped below (a C-level extend per dict)
    for module in modules_of(model):
        tensors += own_parameters(module).values()
        tensors += own_buffers(module).values()
        if type(module) is not original_class(module):
            skipped = getattr(module, "not_read_in_rollouts", ())
            for name, value in vars(module).items():
                # most attributes are flags, settings and the module's own dicts: ruled out by their exact type
                if type(value) in _HOLD_NO_TENSOR or not isinstance(value, _HOLDERS) or name in skipped:
                    continue
                tensors.extend(held(value))
    # oneDNN's packed weights (a CPU backend's) have no storage to point at: the object stands for it
    return tuple((id(t) if t.is_mkldnn else t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors if t is not None)
