"""Building a rollout engine by name: the one place that maps ``rollout.engine`` (training) and
``engine`` (``ngrpo eval``, ``ngrpo diagnose``) to an engine for a live policy."""

from __future__ import annotations

from ..checks import check_choice
from .engine import RolloutEngine
from .hf_engine import HFEngine
from .vllm_support import VLLMVersionError, check_vllm

__all__ = ["ENGINES", "build_engine", "check_engine"]

ENGINES = ("hf", "vllm")


def check_engine(name: str, key: str = "rollout.engine") -> None:
    """Fail (``ValueError`` naming ``key``) on an unknown engine, or on ``vllm`` without a supported
    vLLM installed: before any model loads."""
    check_choice(key, name, ENGINES)
    if name == "vllm":
        try:
            check_vllm()
        except VLLMVersionError as err:
            raise ValueError(str(err).replace("rollout.engine=", f"{key}=")) from err


def build_engine(
    name: str, policy, tokenizer, *, max_new_tokens: int, seed: int, key: str = "rollout.engine", **settings
) -> RolloutEngine:
    """The engine ``name`` for ``policy``: ``hf`` decodes with the policy module itself
    (``settings`` are ``rollout.hf.*``); ``vllm`` loads the policy's directory into vLLM
    (``settings`` are ``rollout.vllm.*``) and must be given the policy's weights with
    ``sync_weights`` whenever they differ from that directory's."""
    check_engine(name, key)
    if name == "hf":
        return HFEngine(policy, tokenizer, max_new_tokens=max_new_tokens, seed=seed, **settings)
    from .vllm_engine import VLLMEngine  # the optional dependency: imported only when asked for

    return VLLMEngine.from_policy(policy, tokenizer, max_new_tokens=max_new_tokens, seed=seed, **settings)
