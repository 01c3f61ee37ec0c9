"""From the config's data and rollout groups to the problems, the rollout DataModule and the
engine's settings, each checked with errors that name the key (see :mod:`.build`)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ngrpo_lightning.config import ConfigError
from ngrpo_lightning.data import load_problems, reasoning_gym_problems
from ngrpo_lightning.rollout import RolloutDataModule, engine_class

__all__ = ["build_datamodule", "build_problems", "engine_settings"]


def build_problems(cfg: DictConfig, seed: int):
    """(train, validation) problems of ``data.source``; data errors (file, line, field) become :class:`ConfigError`."""
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
        engine_kwargs=engine_settings(cfg),
        ignore_eos=r.get("ignore_eos", False),
        instruction=cfg.data.instruction,
        system_prompt=cfg.data.system_prompt,
        seed=cfg.seed,
        max_staleness=(cfg.get("train") or {}).get("max_staleness", 0),
    )


def engine_settings(cfg: DictConfig) -> dict:
    """The settings ``rollout.<settings_key>.*`` of the engine ``rollout.engine`` names (may be empty)."""
    key = engine_class(cfg.rollout.engine).settings_key
    node = cfg.rollout.get(key) if key else None
    return dict(OmegaConf.to_container(node, resolve=True)) if node else {}
