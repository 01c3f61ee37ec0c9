"""Building a rollout engine from its config name (``rollout.engine``; ``engine`` in ``ngrpo eval``, ``ngrpo
diagnose``): a registered engine (``hf``, ``vllm``, :func:`~ngrpo_lightning.rollout.engine.register_engine`) or the
class path of a :class:`~ngrpo_lightning.rollout.engine.RolloutEngine` subclass (``my_pkg.engines.MyEngine``).
"""

from __future__ import annotations

from ngrpo_lightning.registry import import_path
from ngrpo_lightning.rollout.engine import ENGINES, RolloutEngine
from ngrpo_lightning.rollout.hf_engine import HFEngine
from ngrpo_lightning.rollout.vllm_engine import VLLMEngine

__all__ = ["BUILT_IN", "build_engine", "check_engine", "engine_class"]

BUILT_IN = (HFEngine, VLLMEngine)  # registered as "hf" and "vllm" when their modules load


def engine_class(name: str, key: str = "rollout.engine") -> type[RolloutEngine]:
    """The engine class ``name`` stands for; ``ValueError`` naming ``key`` otherwise."""
    if name in ENGINES or not isinstance(name, str) or "." not in name:
        return ENGINES.resolve(name, key)
    try:
        cls = import_path(name, key)
    except ValueError as err:
        raise ValueError(f"{err}; allowed {sorted(ENGINES)} or the class path of an engine") from err
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        raise ValueError(f"{key}={name!r} is not a subclass of ngrpo_lightning.rollout.RolloutEngine")
    return cls


def check_engine(name: str, settings: dict | None = None, key: str = "rollout.engine") -> type[RolloutEngine]:
    """The engine class of ``name``, checked before any model loads: it exists, this machine can run it, and
    ``settings`` (``rollout.<settings_key>.*``) are its own and in range (``ValueError`` naming the key)."""
    cls = engine_class(name, key)
    try:
        cls.check_available()
    except ValueError as err:
        raise ValueError(str(err).replace("rollout.engine=", f"{key}=")) from err
    cls.check_settings(dict(settings or {}), f"rollout.{cls.settings_key or cls.registered_name or cls.__name__}")
    return cls


def build_engine(
    name: str, policy, tokenizer, *, max_new_tokens: int, seed: int, key: str = "rollout.engine", **context_and_settings
) -> RolloutEngine:
    """The engine ``name`` for ``policy`` (:meth:`RolloutEngine.from_policy` takes the common arguments:
    ``ignore_eos``, ``max_prompt_tokens``, ``sharded_root``, ``backend``; the rest are the engine's settings)."""
    common = ("ignore_eos", "max_prompt_tokens", "sharded_root", "backend")
    context = {k: context_and_settings.pop(k) for k in common if k in context_and_settings}
    cls = check_engine(name, context_and_settings, key)
    cls.check_model(policy)
    return cls.from_policy(
        policy, tokenizer, max_new_tokens=max_new_tokens, seed=seed, **context, **context_and_settings
    )
