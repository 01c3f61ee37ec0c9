"""What a rollout's decoding steps write, kept on the device and updated in place.

After a step's logits, :meth:`DecodeState.advance` does the bookkeeping (the explorer's tokens and next inputs, the
answer marker, tokens and log-probs at response position ``t``, rows ending at EOS, the mixed rows' records) with
device tensors only (``t`` too), written into tensors the state owns, so the host never waits and a CUDA graph can
record the whole step (:mod:`.step_graphs`); nothing here may rebind a tensor the next step reads. ``[R, ...]``
tensors are by original row; a step sees every row (``live=None``) or the rows still decoding (``live``: their
original indices).
"""

from __future__ import annotations

import torch

from ngrpo_lightning.explorers import Explorer, explorer_step
from ngrpo_lightning.rollout.padding import pad_to
from ngrpo_lightning.rollout.reconstruction import mixture_vectors
from ngrpo_lightning.rollout.records import NO_NOISE, ComponentHashes, InputRecords

__all__ = ["DecodeState", "mixed_inputs"]


class DecodeState:
    """The outputs of a rollout of ``rows`` rows and up to ``capacity`` tokens, on ``device``.

    Args:
        rows, capacity: R and the longest response the state holds.
        pad_id: the token written where a row emitted nothing.
        eos: [E] long, the ids that end a response.
        temperature: rollout log-probs are ``log_softmax(logits / temperature)``.
        marker: the rows' answer marker (:class:`~.answer_marker.RowAnswerMarker`), or None.
    """

    def __init__(self, rows: int, capacity: int, device, pad_id: int, eos: torch.Tensor, temperature: float, marker):
        self.rows, self.capacity, self.pad_id, self.temperature = rows, capacity, pad_id, temperature
        self.eos, self.marker = eos, marker
        self.tokens = torch.full((rows, capacity), pad_id, dtype=torch.long, device=device)
        self.logprobs = torch.zeros((rows, capacity), device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.lengths = torch.full((rows,), capacity, dtype=torch.long, device=device)  # set when a row ends
        self.t = torch.zeros(1, dtype=torch.long, device=device)  # the response position the next step writes
        self.start = torch.zeros(1, dtype=torch.long, device=device)  # the cache slot of response position 0
        self.slots: dict[str, torch.Tensor] = {}  # the records, by step and row (made at the first mixed step)
        self.explorer_logits: torch.Tensor | None = None  # [R, V]: every row's last logits, once rows have left
        self.noise_hashes = ComponentHashes()  # the noise's per-component half, made once (records.noise_vectors)

    def restart(self, max_new: int, start: int) -> None:
        """Refill the same tensors for a rollout of at most ``max_new`` tokens, the first at cache slot ``start``."""
        self.tokens.fill_(self.pad_id)
        self.logprobs.zero_()
        self.finished.zero_()
        self.lengths.fill_(max_new)
        self.t.zero_()
        self.start.fill_(start)
        if "mixed" in self.slots:
            self.slots["mixed"].zero_()
        if "noise_seed" in self.slots:
            self.slots["noise_seed"].fill_(NO_NOISE)
        if self.marker is not None:
            self.marker.restart()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a step writes (a recorded step must keep writing these, never new ones)."""
        marker = [self.marker.recent, self.marker.answered] if self.marker is not None else []
        logits = [self.explorer_logits] if self.explorer_logits is not None else []
        return [self.tokens, self.logprobs, self.finished, self.lengths, self.t, *self.slots.values(), *marker, *logits]

    def advance(
        self,
        logits: torch.Tensor,
        explorer: Explorer,
        generator: torch.Generator,
        embedding: torch.Tensor,
        live: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step's bookkeeping for ``logits`` ([b, V] float32: every row, or the ``live`` rows). Returns the next
        inputs of the same rows ([b, d]) and moves ``t`` on."""
        whole = live is None
        if not whole:  # the explorer sees every row: the ended rows' last logits stay
            self.explorer_logits.index_copy_(0, live, logits)
        step = explorer_step(explorer, logits if whole else self.explorer_logits, generator)
        if self.marker is not None:  # no mixing after a row's answer marker
            self.marker.unmix(step, ~self.finished)
        running = ~(self.finished if whole else self.finished[live])  # all true unless ended rows decode padding
        token = torch.where(running, step.tokens if whole else step.tokens[live], self.pad_id)
        scaled = logits if self.temperature == 1.0 else logits / self.temperature
        logprob = scaled.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(scaled, -1)  # no B x V output
        logprob = torch.where(running, logprob, 0.0)
        inputs = embedding[token]
        if step.mixed is not None:  # every row's mixture, the mixed ones kept: no look at which rows mixed
            mixed = step.mixed & ~self.finished
            self._record(step, mixed)
            here = mixed if whole else mixed[live]
            inputs = torch.where(here[:, None], mixed_inputs(embedding, step, mixed, live, self.noise_hashes), inputs)
        ended = torch.isin(token, self.eos) & running
        if whole:
            self.tokens.index_copy_(1, self.t, token[:, None])
            self.logprobs.index_copy_(1, self.t, logprob[:, None])
            self.finished |= ended
            self.lengths.copy_(torch.where(ended, self.t + 1, self.lengths))
        else:
            at = (live, self.t.expand_as(live))
            self.tokens.index_put_(at, token)
            self.logprobs.index_put_(at, logprob)
            self.finished.index_copy_(0, live, self.finished[live] | ended)
            self.lengths.index_copy_(0, live, torch.where(ended, self.t + 1, self.lengths[live]))
        self.t += 1
        return inputs

    def _record(self, step, mixed: torch.Tensor) -> None:
        """Keep this step's mixtures at its position ``t`` (read once, when the rollout ends)."""
        fields = {"mixed": mixed, "ids": step.ids, "weights": step.weights.float()}
        if step.noise_seed is not None:
            scale = step.noise_scale
            scale = torch.zeros_like(step.noise_seed, dtype=torch.float) if scale is None else scale.float()
            fields.update(noise_seed=step.noise_seed.long(), noise_scale=scale)
        k = max(step.ids.shape[1], self.slots["ids"].shape[2] if "ids" in self.slots else 0)
        for name, value in fields.items():
            if name in ("ids", "weights"):
                value = pad_to(value, k, 0)
            slot = self.slots.get(name)
            if slot is None or slot.shape[2:] != value.shape[1:]:  # first made, or K grew (an eager step)
                slot = self.slots[name] = self._slot(name, value, slot)
            slot.index_copy_(0, self.t, value[None])

    def _slot(self, name: str, value: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
        fill = NO_NOISE if name == "noise_seed" else 0
        slot = torch.full((self.capacity, *value.shape), fill, dtype=value.dtype, device=self.tokens.device)
        if old is not None:
            slot[..., : old.shape[-1]] = old
        return slot

    def records(self, steps: int) -> InputRecords:
        """The records of the first ``steps`` steps' mixed rows (:meth:`InputRecords.from_dense`)."""
        if "mixed" not in self.slots:
            return InputRecords()
        fields = ("mixed", "ids", "weights", "noise_seed", "noise_scale")
        return InputRecords.from_dense(*(self.slots[f][:steps] if f in self.slots else None for f in fields))


def mixed_inputs(
    embedding: torch.Tensor, step, mixed: torch.Tensor, live: torch.Tensor | None, hashes: ComponentHashes | None = None
) -> torch.Tensor:
    """The mixture of every ``live`` row of ``step`` (every row: ``live=None``), [b, d]; unmixed rows' fields are
    ignored. ``hashes``: as :func:`~.reconstruction.mixture_vectors`'s."""

    def rows(value: torch.Tensor) -> torch.Tensor:
        return value if live is None else value[live]

    here = rows(mixed)
    ids = torch.where(here[:, None], rows(step.ids), 0)
    seed = scale = None
    if step.noise_seed is not None:
        seed = torch.where(here, rows(step.noise_seed), NO_NOISE)
        scale = rows(step.noise_scale) if step.noise_scale is not None else torch.zeros_like(seed, dtype=torch.float32)
    return mixture_vectors(embedding, ids, rows(step.weights), seed, scale, hashes)
