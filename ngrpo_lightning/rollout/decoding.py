"""How a rollout's decoding steps run: on a growing KV cache, or on a kept static one (run as it is, or replayed from
graphs). :class:`~.hf_engine.HFEngine` has one loop; the mode decides the cache, the prefill's mask, each step, and
how ended rows leave. A mode is kept by its engine for the whole run (with :class:`~.static_cache.StaticCaches`).

    mode = decoding_mode(backend)             # the backend's choice (or the engine's settings)
    step = mode.start(engine, model, rows, width, max_new, explorer, start)
    step.cache, step.state                    # what the loop writes through
    logits, batch = step(batch, t)            # one decoding step, the explorer's next inputs made
"""

from __future__ import annotations

import logging

import torch

from ngrpo_lightning.explorers import declares_capturable
from ngrpo_lightning.rollout.decode_graphs import DecodeGraphs
from ngrpo_lightning.rollout.kv_cache import reserved_cache
from ngrpo_lightning.rollout.static_cache import StaticCaches, batch_buckets
from ngrpo_lightning.rollout.step_graphs import Batch, StepGraphs

log = logging.getLogger(__name__)


def decoding_mode(backend, static_cache: bool | None = None, graphs: str | bool | None = None):
    """The decoding mode of an engine: ``static_cache`` / ``graphs`` where given, else its backend's
    (``static_decoding``, ``decode_graphs``, ``decode_whole_steps``); a growing cache without a backend."""
    static = static_cache if static_cache is not None else bool(backend is not None and backend.static_decoding)
    if not static:
        return GrowingCacheDecoding(backend)
    replay = None if graphs is False else graphs if graphs is not None else getattr(backend, "decode_graphs", None)
    whole = backend is None or backend.decode_whole_steps
    return StaticCacheDecoding(replay, whole_steps=whole)


class _Steps:
    """One rollout's decoding steps (what :meth:`start` returns): the cache, the state, each step."""

    static = False
    graphs = None

    def __init__(self, engine, model, state, cache, explorer, gen, embedding, width: int):
        self.model, self.state, self.cache, self.explorer = model, state, cache, explorer
        self.gen, self.embedding, self.width = gen, embedding, width

    def prefill(self, mask: torch.Tensor) -> dict:
        """The prefill's mask and the keyword arguments its forward takes besides the inputs."""
        return {"attention_mask": mask[:, : self.width]}

    def first_batch(self, batch: Batch) -> Batch:
        return batch

    def advance(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, Batch]:
        inputs = self.state.advance(logits, self.explorer, self.gen, self.embedding, batch.live)
        return logits, Batch(inputs[:, None], batch.position + 1, batch.mask, batch.live)

    def fit(self, keep: torch.Tensor, stale: torch.Tensor) -> torch.Tensor:
        """The rows to keep decoding, given the live ones (``keep``) and which rows ended (``stale``)."""
        return keep

    def select(self, batch: Batch, keep: torch.Tensor) -> Batch:
        self.cache.batch_select_indices(keep)
        return batch.select(keep)


class GrowingCacheDecoding:
    """Eager steps on a growing KV cache reserved at the rollout's length, its dtype and width the backend's."""

    def __init__(self, backend=None):
        self.backend = backend

    def start(self, engine, model, rows, width, max_new, explorer, start) -> _Steps:
        store = self.backend.kv_cache_dtype(model) if self.backend is not None else None
        reads = self.backend.kv_read_width(model) if self.backend is not None else None
        cache = reserved_cache(width + max_new, store, reads)
        embedding = model.get_input_embeddings().weight
        state = engine.new_state(rows, max_new, embedding.device, start)
        return _GrowingSteps(engine, model, state, cache, explorer, start.generator, embedding, width)


class _GrowingSteps(_Steps):
    def __call__(self, batch: Batch, t: int) -> tuple[torch.Tensor, Batch]:
        # a decoding step's 4D mask, built here: transformers' own would wait for the device
        out = self.model(
            inputs_embeds=batch.inputs,
            attention_mask=batch.mask[:, : self.width + t].bool()[:, None, None, :],
            position_ids=batch.position,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return self.advance(out.logits[:, -1].float(), batch)


class StaticCacheDecoding:
    """Steps on a kept static KV cache with a full-width mask, the batch in buckets: run as they are (``replay=None``)
    or replayed from graphs per bucket (``"cuda"``, ``"compile"``, ``"rerun"``), the whole step with ``whole_steps``
    where the explorer is ``capturable`` (:mod:`.step_graphs`), else the model's (:mod:`.decode_graphs`)."""

    static = True

    def __init__(self, replay: str | None = None, whole_steps: bool = True):
        self.replay, self.whole_steps = replay, whole_steps
        self.caches = StaticCaches()  # kept across rollouts with their graphs
        self._told: set[type] = set()  # explorer classes said not to be capturable

    def start(self, engine, model, rows, width, max_new, explorer, start) -> _Steps:
        cache, kept = self.caches.get(model, width + max_new, rows)
        embedding = model.get_input_embeddings().weight
        graphs = self._graphs(engine, model, cache, kept, rows, max_new, explorer, start, embedding)
        if isinstance(graphs, StepGraphs):
            return _WholeSteps(engine, model, graphs.state, cache, explorer, start.generator, embedding, width, graphs)
        state = engine.new_state(rows, max_new, embedding.device, start)
        return _StaticSteps(engine, model, state, cache, explorer, start.generator, embedding, width, graphs)

    def _graphs(self, engine, model, cache, kept, rows, max_new, explorer, start, embedding):
        """The graphs of ``cache``, recorded again only where the cache is new or what they recorded changed."""
        if not self.replay:
            return None
        graphs = self.caches.graphs.get(rows)
        if self.replay in ("cuda", "rerun") and self.whole_steps and declares_capturable(explorer):
            gen = start.generator
            if not (
                kept
                and isinstance(graphs, StepGraphs)
                and graphs.replay == self.replay
                and graphs.current(model, cache, explorer, gen, max_new)
            ):
                state = engine.new_state(rows, max_new, cache.layers[0].cumulative_length.device, start)
                graphs = StepGraphs(model, cache, self.replay, state, explorer, gen, embedding)
                self.caches.graphs[rows] = graphs
            return graphs
        if self.replay == "cuda" and self.whole_steps and type(explorer) not in self._told:
            self._told.add(type(explorer))
            log.info(
                "explorer %s does not declare capturable: its steps run between the model's replayed steps "
                "(docs/explorers.md, 'On a GPU, never wait for the host')",
                type(explorer).__name__,
            )
        current = kept and type(graphs) is DecodeGraphs and graphs.replay == self.replay
        if not (current and graphs.current(model, cache)):
            graphs = self.caches.graphs[rows] = DecodeGraphs(model, cache, self.replay)
        return graphs


class _StaticSteps(_Steps):
    static = True

    def __init__(self, engine, model, state, cache, explorer, gen, embedding, width, graphs):
        super().__init__(engine, model, state, cache, explorer, gen, embedding, width)
        self.graphs = graphs
        self.warmup_s = graphs.warmup_s if graphs is not None else 0.0
        self.buckets = batch_buckets(state.lengths.shape[0])
        self.length = cache.layers[0].max_cache_len
        self.columns = torch.arange(self.length, device=embedding.device)

    def prefill(self, mask: torch.Tensor) -> dict:
        """The mask over the cache's full width (columns past the rollout masked), and where it writes."""
        return {"attention_mask": mask, "cache_position": torch.arange(self.width, device=mask.device)}

    def full_width(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(mask, (0, self.length - mask.shape[1]))

    def fit(self, keep: torch.Tensor, stale: torch.Tensor) -> torch.Tensor:
        """To the smallest bucket that holds the live rows, topped up with ended ones."""
        size = next(b for b in self.buckets if b >= len(keep))
        return torch.cat([keep, stale.nonzero().squeeze(-1)])[:size]

    def __call__(self, batch: Batch, t: int) -> tuple[torch.Tensor, Batch]:
        at = self.state.start + (t - 1)  # the cache slot this step writes
        if self.graphs is not None:  # the mask built here, causal up to this step
            step_mask = (batch.mask.bool() & (self.columns < self.width + t))[:, None, None, :]
            logits = self.graphs(batch.inputs, batch.position, step_mask, at)
            # the graph's buffer is overwritten by the next step: a copy (a half model's cast is one)
            logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
        else:
            out = self.model(
                inputs_embeds=batch.inputs,
                attention_mask=batch.mask,
                position_ids=batch.position,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
                cache_position=at,
            )
            logits = out.logits[:, -1].float()
        return self.advance(logits, batch)


class _WholeSteps(_StaticSteps):
    """Whole steps from graphs: a step writes the state and the batch's next inputs itself."""

    def first_batch(self, batch: Batch) -> Batch:
        return self.graphs.batch(len(self.state.lengths)).fill(batch)

    def __call__(self, batch: Batch, t: int) -> tuple[torch.Tensor, Batch]:
        return self.graphs.step(batch), batch

    def select(self, batch: Batch, keep: torch.Tensor) -> Batch:
        return self.graphs.batch(len(keep)).fill(super().select(batch, keep))
