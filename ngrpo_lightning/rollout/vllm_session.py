"""One ``generate`` call of the vLLM engine with an explorer deciding its steps inside vLLM's loop.

:func:`ngrpo_lightning.compat.vllm.install` wraps two methods of vLLM's model runner to hand each decoding step to the
engine's :class:`RolloutSession`: :meth:`RolloutSession.sample` sees the raw logits of every scheduled request (the
explorer, or vLLM's sampler, decides the tokens; log-probs are kept), :meth:`RolloutSession.overwrite_inputs` puts
the mixtures into the step's input embeddings. Per step the work is batch-wide, copied to the host only on steps with
mixed rows; log-probs and records become tensors once, at the end (:meth:`RolloutSession.logprob_table`,
:meth:`RolloutSession.input_records`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ngrpo_lightning.compat import vllm as vllm_compat
from ngrpo_lightning.explorers import Explorer, ExplorerStep, explorer_step
from ngrpo_lightning.rollout.answer_marker import AnswerMarker
from ngrpo_lightning.rollout.reconstruction import mixture_embeddings
from ngrpo_lightning.rollout.records import ComponentHashes, InputRecords

__all__ = ["RolloutSession", "StepLogprobs", "StepRecords"]


class StepLogprobs(NamedTuple):
    """The rollout log-probs of one decoding step, in vLLM's batch order of that step."""

    req_ids: list[str]  # [n] request ids
    pos: np.ndarray  # [n] response position of each sampled token; -1: discarded (a partial prefill chunk)
    logprobs: torch.Tensor  # [n] log_softmax(logits / T)[token], on the logits' device


class StepRecords(NamedTuple):
    """The non-discrete steps of one decoding step: ``records.row`` indexes ``req_ids``, ``records.pos`` is each
    request's response position (renumbered at the end, :meth:`RolloutSession.input_records`)."""

    req_ids: list[str]
    records: InputRecords


@dataclass
class RolloutSession:
    """State of one ``generate`` call, shared with the patched runner (``explorer`` None: vLLM samples). Kept per
    step: log-probs and records; per request id: mixed input vectors by response position (``_preprocess`` feeds
    them back)."""

    embedding: torch.Tensor  # E [V, d], vLLM's own copy (the weights it decodes with)
    temperature: float  # log-probs are taken at this temperature (T = 0 counts as 1)
    explorer: Explorer | None = None
    generator: torch.Generator | None = None
    steps: list[StepLogprobs] = field(default_factory=list)
    records: list[StepRecords] = field(default_factory=list)
    mixtures: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    marker: AnswerMarker | None = None  # explorer.answer_start's token ids, if it has one
    hashes: ComponentHashes = field(default_factory=ComponentHashes)  # the noise's per-component half, made once

    # ------------------------------------------------------------- per step
    def sample(self, runner, logits: torch.Tensor, native_sample):
        """One decoding step of all scheduled requests (rows in ``input_batch`` order)."""
        scaled = logits.float() if self.temperature == 1.0 else logits.float() / self.temperature
        logp = scaled.log_softmax(-1)  # before vLLM's sampler, which may scale logits in place (one fused pass)
        if self.explorer is None:
            out = native_sample()
            tokens, step = out.sampled_token_ids[:, 0].long(), None
        else:
            step = explorer_step(self.explorer, logits.float(), self.generator)
            tokens = step.tokens
            out = vllm_compat.sampler_output(tokens)  # the explorer's tokens replace vLLM's sampler
        req_ids, pos = vllm_compat.sampled_positions(runner, len(tokens))
        if step is not None and self.marker is not None:  # no mixing after a request's answer marker
            self.marker.unmix(step, req_ids, torch.from_numpy(pos >= 0))
        self.steps.append(StepLogprobs(req_ids, pos, logp.gather(-1, tokens[:, None]).squeeze(-1)))
        if step is not None and step.mixed is not None:
            self._record_mixtures(step, req_ids, pos)
        return out

    def _record_mixtures(self, step: ExplorerStep, req_ids: list[str], pos: np.ndarray) -> None:
        keep = step.mixed & torch.from_numpy(pos >= 0).to(step.mixed.device)
        rec = InputRecords.from_step(step, keep, 0)
        if not len(rec):
            return
        rows = rec.row.cpu().numpy()
        rec = dataclasses.replace(rec, pos=torch.from_numpy(pos[rows]).to(rec.row.device))
        self.records.append(StepRecords(req_ids, rec))
        vectors = mixture_embeddings(self.embedding, rec, self.hashes)
        for row, p, vector in zip(rows.tolist(), pos[rows].tolist(), vectors):
            self.mixtures.setdefault(req_ids[row], {})[p] = vector

    def overwrite_inputs(self, runner, inputs_embeds: torch.Tensor) -> None:
        """Put the recorded mixtures into this step's ``inputs_embeds`` rows."""
        if not self.mixtures:
            return
        # this step's inputs are the absolute positions computed .. computed + count - 1; response
        # token `p` sits at prompt_len + p (a decode step: one position; a recompute: many)
        req_ids, starts, first = vllm_compat.step_inputs(runner)
        rows, vectors = [], []
        for i, req_id in enumerate(req_ids):
            mixed = self.mixtures.get(req_id)
            if not mixed:
                continue
            start, count = starts[i], starts[i + 1] - starts[i]
            if count == 1:
                vector = mixed.get(first[i])
                if vector is not None:
                    rows.append(start)
                    vectors.append(vector)
                continue
            for p, vector in mixed.items():
                if first[i] <= p < first[i] + count:
                    rows.append(start + p - first[i])
                    vectors.append(vector)
        if rows:
            index = torch.tensor(rows, device=inputs_embeds.device)
            inputs_embeds[index] = torch.stack(vectors).to(inputs_embeds.dtype)

    # ---------------------------------------------------------- at the end
    def logprob_table(self, row_of: dict[str, int], lengths: torch.Tensor, width: int) -> torch.Tensor:
        """The rollout log-probs [R, width] (``row_of``: request id -> row, ``lengths``: response lengths [R];
        positions past a response stay 0)."""
        table = torch.zeros(len(lengths), width)
        if not self.steps:
            return table
        logprobs = torch.cat([s.logprobs for s in self.steps]).float().cpu()
        pos = torch.from_numpy(np.concatenate([s.pos for s in self.steps]))
        rows = torch.tensor([row_of.get(r, -1) for s in self.steps for r in s.req_ids], dtype=torch.long)
        keep = (rows >= 0) & (pos >= 0) & (pos < lengths[rows.clamp(min=0)])
        table[rows[keep], pos[keep]] = logprobs[keep]
        return table

    def input_records(self, row_of: dict[str, int], lengths: torch.Tensor) -> InputRecords:
        """The rollout's records, rows renumbered by ``row_of`` (request id -> row), ordered by row and position,
        those past a response's end (``lengths``) dropped."""
        parts = []
        for chunk in self.records:
            rec = chunk.records.to("cpu")
            rows = torch.tensor([row_of.get(r, -1) for r in chunk.req_ids], dtype=torch.long)[rec.row]
            keep = (rows >= 0) & (rec.pos < lengths[rows.clamp(min=0)])
            parts.append(
                InputRecords(
                    row=rows[keep],
                    pos=rec.pos[keep],
                    ids=rec.ids[keep],
                    weights=rec.weights[keep],
                    noise_seed=rec.noise_seed[keep].long(),
                    noise_scale=rec.noise_scale[keep].float(),
                )
            )
        out = InputRecords.concat(parts)
        if len(out):
            order = torch.argsort(out.row * (int(out.pos.max()) + 1) + out.pos, stable=True)
            out = InputRecords(**{k: v[order] for k, v in vars(out).items()})
        return out

    def request_ids(self) -> set[str]:
        """The ids of every request this session saw (vLLM's internal ids)."""
        return {r for s in self.steps for r in s.req_ids}
