"""Whole decoding steps replayed from CUDA graphs: the model, the explorer and the bookkeeping.

Where the explorer declares it can be recorded (:func:`~ngrpo_lightning.explorers.base.declares_capturable`),
:class:`StepGraphs` records per batch bucket what :class:`~.decode_graphs.DecodeGraphs` leaves between replays (the
explorer, sampling, log-prob, records, rows' ends): the step reads its inputs from buffers of its own (:class:`Batch`),
writes the rollout's outputs into the kept :class:`~.decode_state.DecodeState` and the next step's inputs into the
same buffers. The host only replays. It is exact: the step moves its position ``t`` (a device tensor) itself; the
sampling generator is registered with every graph, so a replay draws what the eager step would; nothing the step
writes is a new tensor (``replay="rerun"`` checks it on the CPU). Graphs, state and buffers are kept across rollouts
while :meth:`StepGraphs.current` holds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ngrpo_lightning.rollout.decode_graphs import DecodeGraphs, _Recorded, decode_step
from ngrpo_lightning.rollout.decode_state import DecodeState

__all__ = ["Batch", "StepGraphs", "fingerprint"]


@dataclass
class Batch:
    """The decoding batch's inputs to its next step: the rows still decoding, in order."""

    inputs: torch.Tensor  # [b, 1, d] input embeddings
    position: torch.Tensor  # [b, 1] position ids
    mask: torch.Tensor  # [b, L] the attention mask over the cache's columns (1: a prompt or response token)
    live: torch.Tensor | None  # [b] the rows' original indices; None: every row, in order

    def select(self, keep: torch.Tensor) -> Batch:
        """The rows at ``keep`` (indices into this batch)."""
        live = keep if self.live is None else self.live[keep]
        return Batch(self.inputs[keep], self.position[keep], self.mask[keep], live)

    def fill(self, other: Batch) -> Batch:
        """Copy ``other``'s values into these tensors (a graph reads these)."""
        for name in ("inputs", "position", "mask", "live"):
            if getattr(self, name) is not None:
                getattr(self, name).copy_(getattr(other, name))
        return self

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None]


class StepGraphs(DecodeGraphs):
    """Replays whole decoding steps of ``model`` on ``cache`` with ``explorer``, writing ``state``.

    Args:
        model, cache, replay: as :class:`~.decode_graphs.DecodeGraphs` (``"cuda"`` or ``"rerun"``).
        state: the rollout outputs the steps write (kept with the graphs).
        explorer, generator: the explorer the steps run and the generator they draw from.
        embedding: the model's input embedding matrix (the next inputs are its rows or mixtures).
    """

    def __init__(self, model, cache, replay: str, state: DecodeState, explorer, generator, embedding):
        if replay not in ("cuda", "rerun"):
            raise ValueError(f"replay={replay!r}: whole steps are recorded with 'cuda' or checked with 'rerun'")
        super().__init__(model, cache, replay)
        self.state, self.explorer, self.generator, self.embedding = state, explorer, generator, embedding
        self.explorer_print = fingerprint(explorer)
        self.batches: dict[int, Batch] = {}
        self.columns = torch.arange(cache.layers[0].max_cache_len, device=embedding.device)

    def current(self, model, cache, explorer=None, generator=None, capacity: int = 0) -> bool:
        """As :meth:`DecodeGraphs.current`, and the same generator, an explorer as recorded, and a state that holds
        ``capacity`` tokens."""
        return (
            super().current(model, cache)
            and generator is self.generator
            and capacity <= self.state.capacity
            and fingerprint(explorer) == self.explorer_print
        )

    def __call__(self, *args, **kwargs):
        raise TypeError("StepGraphs replays whole decoding steps: call step(batch), not the model's step alone")

    def batch(self, rows: int) -> Batch:
        """The buffers of the ``rows``-row bucket's step (the whole batch: ``rows == R``)."""
        if rows not in self.batches:
            d, length = self.embedding.shape[1], len(self.columns)
            device = self.embedding.device
            self.batches[rows] = Batch(
                torch.empty(rows, 1, d, dtype=self.embedding.dtype, device=device),
                torch.empty(rows, 1, dtype=torch.long, device=device),
                torch.empty(rows, length, dtype=torch.long, device=device),
                None if rows == self.state.rows else torch.empty(rows, dtype=torch.long, device=device),
            )
        return self.batches[rows]

    def step(self, batch: Batch) -> torch.Tensor:
        """Replay the step of ``batch`` (its own buffers, :meth:`batch`), recorded the first time: its logits [b, V]
        float32, a buffer the next step overwrites."""
        rows = batch.inputs.shape[0]
        entry = self.recorded.get(rows)
        if entry is None:
            entry = self.recorded[rows] = self._record_step(batch)
            if entry.graph is None:  # "rerun": the step ran as it was recorded
                return entry.logits
        if entry.graph is None:
            written = self._written(batch)
            entry.logits = self._run(batch)
            if self._written(batch) != written:
                raise RuntimeError(
                    f"explorer {type(self.explorer).__name__} declares capturable, but its step replaced a "
                    "tensor the next step reads: a recorded step would keep reading the old one"
                )
            return entry.logits
        entry.graph.replay()
        return entry.logits

    def _written(self, batch: Batch) -> tuple:
        """The addresses of every tensor a step writes or reads between steps."""
        return (
            tuple(t.data_ptr() for t in self.state.tensors() + batch.tensors()),
            fingerprint(self.explorer),
        )

    def _model_step(self, batch: Batch) -> torch.Tensor:
        at = self.state.start + self.state.t - 1  # the cache slot this step writes
        mask = (batch.mask.bool() & (self.columns <= at))[:, None, None, :]
        inputs = {"inputs_embeds": batch.inputs, "position_ids": batch.position, "attention_mask": mask}
        return decode_step(self.model, self.cache, {**inputs, "cache_position": at})

    def _run(self, batch: Batch) -> torch.Tensor:
        logits = self._model_step(batch).float()  # a half model's: a cast; float32: read before the next step
        inputs = self.state.advance(logits, self.explorer, self.generator, self.embedding, batch.live)
        batch.inputs.copy_(inputs[:, None])
        batch.position += 1
        return logits

    def _record_step(self, batch: Batch) -> _Recorded:
        if self.replay == "rerun":
            return _Recorded({}, self._run(batch), None)
        # The model's step warms up on a side stream; the bookkeeping's writes must happen once, in the replay
        name = type(self.explorer).__name__
        way_out = (
            f"an explorer ({name}) whose step cannot be recorded must not declare capturable; or record the "
            "model's step alone with backend.disable=[whole_step_graphs]; or "
        )
        return self._capture(lambda: self._model_step(batch), lambda: self._run(batch), self.generator, way_out=way_out)


def fingerprint(obj, depth: int = 3) -> tuple:
    """What a recorded step took from ``obj`` (an explorer): its class, public plain settings and where its tensors
    lie, looking ``depth`` levels into the objects it holds; anything else counts by its type."""
    if obj is None:
        return ()
    items = []
    for name, value in sorted(vars(obj).items()):
        if isinstance(value, torch.Tensor):
            items.append((name, value.data_ptr(), tuple(value.shape), value.dtype, value.device))
        elif _plain(value):
            if not name.startswith("_"):
                items.append((name, value))
        elif depth and hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
            items.append((name, fingerprint(value, depth - 1)))
        else:
            items.append((name, type(value).__qualname__))
    return (type(obj).__qualname__, tuple(items))


def _plain(value) -> bool:
    if isinstance(value, tuple | list | frozenset):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)
