"""The explorers inside vLLM's decoding loop: a patch of two methods of one model runner.

vLLM offers no API to feed a mixed embedding at a decode step. The patch is the smallest we
found: it wraps two methods of the *instance* (never the class) of vLLM's Model Runner V1
(``vllm/v1/worker/gpu_model_runner.py``; the CPU build's runner subclasses it).

``_sample(logits, ...)``
    Sees the raw logits of every scheduled request. With an explorer, the explorer decides
    the step (emitted token, and for non-discrete rows the mixture that becomes the next
    input) and the runner is handed the tokens; with plain sampling vLLM's own sampler runs
    unchanged. Either way the rollout log-prob ``log_softmax(logits / T)[token]`` is kept.
``_preprocess(...)``
    Builds the step's ``inputs_embeds`` (the runner does so when vLLM is started with
    ``enable_prompt_embeds=True``); the wrapper then overwrites the rows of positions whose
    input was mixed. The rows are views of the runner's persistent input buffer, the one its
    CUDA graphs were captured on, so the overwrite reaches graph replays too (docs/vllm.md).
    Requests are keyed by request id, since vLLM reorders batch rows between steps, and
    positions are absolute, so a preempted request that is recomputed from its tokens gets
    its mixtures back. Prefix caching must be off: a cached prefix would skip the overwrite.

Per decoding step ``_sample`` does batch-wide work only (numpy over the batch, tensors kept on
the logits' device): no per-request Python loop, and no device-to-host copy except on steps
with mixed rows; ``_preprocess`` looks each request's mixtures up once. The per-step log-probs
and records become the rollout's tensors once, at the end (:meth:`RolloutSession.logprob_table`,
:meth:`RolloutSession.input_records`).

The runner's internals used here (``input_batch.req_ids``, ``num_tokens_no_spec``,
``query_start_loc``, ``discard_request_mask``, ...) are those of the supported releases
(:mod:`.vllm_support`); :func:`check_runner` checks the runner's class and that they exist.
Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``) has none of them: docs/vllm.md says
what a port to it needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ngrpo_lightning.explorers import Explorer, ExplorerStep, explorer_step
from ngrpo_lightning.rollout.answer_marker import AnswerMarker
from ngrpo_lightning.rollout.reconstruction import mixture_embeddings
from ngrpo_lightning.rollout.records import InputRecords
from ngrpo_lightning.rollout.vllm_support import VLLMRunnerError, VLLMVersionError, vllm_label

PATCHED_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"  # Model Runner V1: the class the patch is written for
RUNNER_ATTRIBUTES = (
    "_sample",
    "_preprocess",
    "input_batch",
    "query_start_loc",
    "discard_request_mask",
    "enable_prompt_embeds",
    "inputs_embeds",
)
INPUT_BATCH_ATTRIBUTES = ("req_ids", "num_reqs", "num_tokens_no_spec", "num_prompt_tokens", "num_computed_tokens_cpu")


class StepLogprobs(NamedTuple):
    """The rollout log-probs of one decoding step, in vLLM's batch order of that step."""

    req_ids: list[str]  # [n] request ids
    pos: np.ndarray  # [n] response position of each sampled token; -1: discarded (a partial prefill chunk)
    logprobs: torch.Tensor  # [n] log_softmax(logits / T)[token], on the logits' device


class StepRecords(NamedTuple):
    """The non-discrete steps of one decoding step: ``records.row`` indexes ``req_ids`` and
    ``records.pos`` is each request's response position (rows are renumbered to the rollout's
    at the end, :meth:`RolloutSession.input_records`)."""

    req_ids: list[str]
    records: InputRecords


@dataclass
class RolloutSession:
    """State of one ``generate`` call, shared with the patched runner.

    ``explorer`` None means plain sampling by vLLM itself. Kept per step: the log-probs and
    the records; per request id: the mixed input vectors by response position (what
    ``_preprocess`` feeds back).
    """

    embedding: torch.Tensor  # E [V, d], vLLM's own copy (the weights it decodes with)
    temperature: float  # log-probs are taken at this temperature (T = 0 counts as 1)
    explorer: Explorer | None = None
    generator: torch.Generator | None = None
    steps: list[StepLogprobs] = field(default_factory=list)
    records: list[StepRecords] = field(default_factory=list)
    mixtures: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    marker: AnswerMarker | None = None  # explorer.answer_start's token ids, if it has one

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
            out = _sampler_output(tokens)  # the explorer's tokens replace vLLM's sampler
        n = len(tokens)
        batch = runner.input_batch
        req_ids = batch.req_ids[:n]  # a copy: the runner reuses its list
        # the sampled token's response position: the request's tokens so far minus its prompt
        pos = batch.num_tokens_no_spec[:n].astype(np.int64) - batch.num_prompt_tokens[:n]
        pos[runner.discard_request_mask.np[:n]] = -1
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
        for row, p, vector in zip(rows.tolist(), pos[rows].tolist(), mixture_embeddings(self.embedding, rec)):
            self.mixtures.setdefault(req_ids[row], {})[p] = vector

    def overwrite_inputs(self, runner, inputs_embeds: torch.Tensor) -> None:
        """Put the recorded mixtures into this step's ``inputs_embeds`` rows."""
        if not self.mixtures:
            return
        batch = runner.input_batch
        n = batch.num_reqs
        starts = runner.query_start_loc.np[: n + 1].tolist()
        # this step's inputs are the absolute positions computed .. computed + count - 1; response
        # token `p` sits at prompt_len + p (a decode step: one position; a recompute: many)
        first = (batch.num_computed_tokens_cpu[:n].astype(np.int64) - batch.num_prompt_tokens[:n]).tolist()
        rows, vectors = [], []
        for i, req_id in enumerate(batch.req_ids[:n]):
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
        """The rollout log-probs [R, width] of the responses (``row_of``: request id -> row,
        ``lengths``: response lengths [R]; positions past a response stay 0)."""
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
        """The rollout's records, rows renumbered by ``row_of`` (request id -> row) and ordered
        by row and position; records past a response's end (``lengths``) are dropped."""
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


def _sampler_output(tokens: torch.Tensor):
    from vllm.v1.outputs import SamplerOutput

    return SamplerOutput(sampled_token_ids=tokens.to(torch.int32)[:, None], logprobs_tensors=None)


def runner_class(runner) -> str:
    """The qualified class name of a model runner (what start-up errors name)."""
    cls = type(runner)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_runner(runner) -> None:
    """Fail clearly unless ``runner`` is the model runner the patch is written for: Model
    Runner V1 (:data:`PATCHED_RUNNER` or a subclass) with the internals the wrappers use."""
    if PATCHED_RUNNER not in {f"{c.__module__}.{c.__qualname__}" for c in type(runner).__mro__}:
        raise VLLMRunnerError(
            f"vLLM ({vllm_label()}) started the model runner {runner_class(runner)}, but the in-loop explorers of "
            f"rollout.engine=vllm are patched into Model Runner V1 ({PATCHED_RUNNER}) and would not run in it. "
            "The engine asks for V1 (VLLM_USE_V2_MODEL_RUNNER=0); vLLM overrides that for features only V2 has "
            "(watermarking, HiSparse attention): remove such settings from rollout.vllm.engine_kwargs, or use the "
            "default engine: rollout.engine=hf. What a port to Model Runner V2 needs: docs/vllm.md"
        )
    missing = [a for a in RUNNER_ATTRIBUTES if not hasattr(runner, a)]
    missing += [
        f"input_batch.{a}"
        for a in INPUT_BATCH_ATTRIBUTES
        if hasattr(runner, "input_batch") and not hasattr(runner.input_batch, a)
    ]
    if missing:
        raise VLLMVersionError(
            f"vLLM's model runner {runner_class(runner)} ({vllm_label()}) lacks {missing}: this "
            "vLLM release is not one the in-loop explorers support (see "
            "ngrpo_lightning.rollout.vllm_support)"
        )


def install(runner) -> None:
    """Wrap ``runner._sample`` and ``runner._preprocess`` (once), after :func:`check_runner`.
    The wrappers do nothing unless ``runner.ngrpo_session`` holds a :class:`RolloutSession`."""
    check_runner(runner)
    if not runner.enable_prompt_embeds:
        raise RuntimeError(
            "vLLM must be started with enable_prompt_embeds=True for the explorers to set input embeddings"
        )
    if getattr(runner, "ngrpo_patched", False):
        return
    sample, preprocess = runner._sample, runner._preprocess
    runner.ngrpo_session = None

    def _sample(logits, spec_decode_metadata):
        session = runner.ngrpo_session
        if session is None or logits is None:
            return sample(logits, spec_decode_metadata)
        if spec_decode_metadata is not None:
            raise RuntimeError("speculative decoding cannot be combined with ngrpo-lightning's explorers")
        return session.sample(runner, logits, lambda: sample(logits, spec_decode_metadata))

    def _preprocess(*args, **kwargs):
        out = preprocess(*args, **kwargs)
        session, inputs_embeds = runner.ngrpo_session, out[1]
        if session is not None and inputs_embeds is not None:
            session.overwrite_inputs(runner, inputs_embeds)
        return out

    runner._sample, runner._preprocess = _sample, _preprocess
    runner.ngrpo_patched = True
