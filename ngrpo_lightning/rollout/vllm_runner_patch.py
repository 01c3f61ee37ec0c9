"""The explorers inside vLLM's decoding loop: a patch of two methods of one model runner.

vLLM offers no API to feed a mixed embedding at a decode step. The patch is the smallest we
found: it wraps two methods of the *instance* (never the class) of vLLM's model runner.

``_sample(logits, ...)``
    Sees the raw logits of every scheduled request. With an explorer, the explorer decides
    the step (emitted token, and for non-discrete rows the mixture that becomes the next
    input) and the runner is handed the tokens; with plain sampling vLLM's own sampler runs
    unchanged. Either way the rollout log-prob ``log_softmax(logits / T)[token]`` is kept.
``_preprocess(...)``
    Builds the step's ``inputs_embeds`` (the runner does so when vLLM is started with
    ``enable_prompt_embeds=True``); the wrapper then overwrites the rows of positions whose
    input was mixed. Requests are keyed by request id, since vLLM reorders batch rows
    between steps, and positions are absolute, so a preempted request that is recomputed
    from its tokens gets its mixtures back. Prefix caching must be off: a cached prefix
    would skip the overwrite.

The runner's internals used here (``input_batch.req_ids``, ``query_start_loc``,
``discard_request_mask``, ``requests[...]``) are those of the supported releases
(:mod:`.vllm_support`); :func:`install` checks they exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..explorers import Explorer
from .reconstruction import mixture_embeddings
from .records import InputRecords

RUNNER_ATTRIBUTES = ("_sample", "_preprocess", "input_batch", "query_start_loc", "discard_request_mask", "requests",
                     "enable_prompt_embeds", "inputs_embeds")


@dataclass
class RolloutSession:
    """State of one ``generate`` call, shared with the patched runner.

    ``explorer`` None means plain sampling by vLLM itself. Per request id: the rollout
    log-probs by response position, the mixed input vectors by position, and the records.
    """

    embedding: torch.Tensor  # E [V, d], vLLM's own copy (the weights it decodes with)
    temperature: float  # log-probs are taken at this temperature (T = 0 counts as 1)
    explorer: Explorer | None = None
    generator: torch.Generator | None = None
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    mixtures: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    records: dict[str, list[tuple]] = field(default_factory=dict)

    def sample(self, runner, logits: torch.Tensor, native_sample):
        """One decoding step of all scheduled requests (rows in ``input_batch`` order)."""
        scaled = logits.float() if self.temperature == 1.0 else logits.float() / self.temperature
        log_z = torch.logsumexp(scaled, -1)  # before vLLM's sampler, which may scale logits in place
        if self.explorer is None:
            out = native_sample()
            tokens, step = out.sampled_token_ids[:, 0].long(), None
        else:
            step = self.explorer.step(logits.float(), generator=self.generator)
            tokens = step.tokens
            out = _sampler_output(tokens)  # the explorer's tokens replace vLLM's sampler
        logprobs = (scaled.gather(-1, tokens[:, None]).squeeze(-1) - log_z).tolist()
        num_reqs = len(tokens)
        discard = runner.discard_request_mask.np[:num_reqs]
        req_ids = runner.input_batch.req_ids[:num_reqs]
        positions = []
        for i, req_id in enumerate(req_ids):
            pos = len(runner.requests[req_id].output_token_ids) if not discard[i] else -1
            positions.append(pos)
            if pos >= 0:
                self.logprobs.setdefault(req_id, {})[pos] = logprobs[i]
        if step is not None and step.mixed is not None:
            self._record_mixtures(step, req_ids, positions)
        return out

    def _record_mixtures(self, step, req_ids, positions) -> None:
        keep = torch.tensor([p >= 0 for p in positions], dtype=torch.bool, device=step.mixed.device)
        rec = InputRecords.from_step(step, step.mixed & keep, 0)  # positions differ per request: kept below
        if not len(rec):
            return
        vectors = mixture_embeddings(self.embedding, rec)
        for j, row in enumerate(rec.row.tolist()):
            req_id, pos = req_ids[row], positions[row]
            self.mixtures.setdefault(req_id, {})[pos] = vectors[j]
            self.records.setdefault(req_id, []).append(
                (pos, rec.ids[j].cpu(), rec.weights[j].cpu(), int(rec.noise_seed[j]), float(rec.noise_scale[j])))

    def overwrite_inputs(self, runner, inputs_embeds: torch.Tensor) -> None:
        """Put the recorded mixtures into this step's ``inputs_embeds`` rows."""
        if not self.mixtures:
            return
        batch = runner.input_batch
        starts = runner.query_start_loc.np
        for i, req_id in enumerate(batch.req_ids):
            mixed = self.mixtures.get(req_id)
            if not mixed:
                continue
            # this step's inputs are the absolute positions computed .. computed + count - 1; response
            # token `pos` sits at prompt_len + pos (a decode step: one position; a recompute: many)
            computed = int(batch.num_computed_tokens_cpu[i])
            first = computed - runner.requests[req_id].num_prompt_tokens
            for offset in range(max(0, -first), int(starts[i + 1] - starts[i])):
                vector = mixed.get(first + offset)
                if vector is not None:
                    inputs_embeds[int(starts[i]) + offset] = vector


def _sampler_output(tokens: torch.Tensor):
    from vllm.v1.outputs import SamplerOutput

    return SamplerOutput(sampled_token_ids=tokens.to(torch.int32)[:, None], logprobs_tensors=None)


def install(runner) -> None:
    """Wrap ``runner._sample`` and ``runner._preprocess`` (once). The wrappers do nothing
    unless ``runner.ngrpo_session`` holds a :class:`RolloutSession`."""
    missing = [a for a in RUNNER_ATTRIBUTES if not hasattr(runner, a)]
    if missing:
        from .vllm_support import VLLMVersionError

        raise VLLMVersionError(f"vLLM's model runner {type(runner).__name__} lacks {missing}: this vLLM release is not "
                               "one the in-loop explorers support (see ngrpo_lightning.rollout.vllm_support)")
    if not runner.enable_prompt_embeds:
        raise RuntimeError("vLLM must be started with enable_prompt_embeds=True for the explorers to set input embeddings")
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
