"""From the config's data and rollout groups to the problems, the rollout DataModule and the
engine's settings, each checked with errors that name the key (see :mod:`.build`)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from .checks import check_number
from .config import ConfigError, named_error
from .data import load_problems, reasoning_gym_problems
from .rollout import RolloutDataModule
from .rollout import check_engine as check_engine_name

__all__ = ["build_datamodule", "build_problems", "check_engine", "engine_kwargs"]


def build_problems(cfg: DictConfig, seed: int):
    """(train problems, validation problems) for ``data.source``; data errors become
    :class:`ConfigError` (they already name the file, line and field)."""
    try:
        return _problems(cfg, seed)
    except (ValueError, KeyError) as err:
        raise ConfigError(str(err).strip('"')) from err


def _problems(cfg: DictConfig, seed: int):
    if cfg.source == "files":
        fields = {"problem_field": cfg.problem_field, "answer_field": cfg.answer_field, "id_field": cfg.id_field}
        train = load_problems(cfg.train, split=cfg.split, limit=cfg.limit, **fields)
        val = load_problems(cfg.val, split=cfg.val_split, limit=cfg.val_limit, **fields) if cfg.val else []
        return train, val
    if cfg.source == "reasoning_gym":
        kw = {"tasks": cfg.tasks, "seed": seed, "verifier": cfg.verifier}
        train = reasoning_gym_problems(size=cfg.train_size, split="train", **kw)
        val = reasoning_gym_problems(size=cfg.val_size, split="validation", **kw) if cfg.val_size else []
        return train, val
    raise ConfigError(f"data.source={cfg.source!r} is unknown: allowed ['files', 'reasoning_gym']")


def build_datamodule(cfg: DictConfig, tokenizer, problems=None):
    """The rollout DataModule; ``problems`` = (train, val) if already built."""
    train, val = problems or build_problems(cfg.data, cfg.seed)
    r = cfg.rollout
    return RolloutDataModule(
        tokenizer,
        train,
        val,
        prompts_per_step=cfg.data.prompts_per_step,
        group_size=r.group_size,
        max_new_tokens=r.max_new_tokens,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        val_samples=r.val_samples,
        val_batch_size=r.val_batch_size,
        engine=r.engine,
        engine_kwargs=engine_kwargs(cfg),
        instruction=cfg.data.instruction,
        system_prompt=cfg.data.system_prompt,
        seed=cfg.seed,
    )


HF_ENGINE_KEYS = ("drop_min_frac", "packed_weights")  # rollout.hf.*


def engine_kwargs(cfg: DictConfig) -> dict:
    """The engine's settings: ``rollout.hf.*`` or ``rollout.vllm.*`` (nulls dropped)."""
    if cfg.rollout.engine != "vllm":
        return dict(OmegaConf.to_container(cfg.rollout.get("hf") or {}, resolve=True))
    settings = {
        k: v for k, v in OmegaConf.to_container(cfg.rollout.get("vllm") or {}, resolve=True).items() if v is not None
    }
    settings.setdefault("max_model_len", cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)
    return settings


def check_engine(cfg: DictConfig) -> None:
    """An unknown ``rollout.engine``, or ``vllm`` without a supported vLLM, fails before any model loads."""
    try:
        check_engine_name(cfg.rollout.engine, "rollout.engine")
    except ValueError as err:
        raise named_error(err, "rollout.engine") from err
    hf = cfg.rollout.get("hf") or {}
    unknown = set(hf) - set(HF_ENGINE_KEYS)
    if unknown:
        raise ConfigError(f"rollout.hf.{sorted(unknown)[0]} is unknown: allowed {list(HF_ENGINE_KEYS)}")
    try:
        check_number("rollout.hf.drop_min_frac", hf.get("drop_min_frac", 0.0), 0.0, 1.0)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if not isinstance(hf.get("packed_weights", True), bool):
        raise ConfigError(f"rollout.hf.packed_weights={hf.packed_weights!r} must be true or false")
