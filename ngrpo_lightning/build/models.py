"""The models of a run: the backend (how they compute), the policy's adapters, the frozen reference, activation
checkpointing (``backend.*``, ``model.*``), their checks, and ``trainer.parallel`` (FSDP2), deciding some of them."""

from __future__ import annotations

import warnings

import torch
from omegaconf import DictConfig, OmegaConf

from ngrpo_lightning.backends import Backend, attention, backend_class, file_weights, select_backend
from ngrpo_lightning.backends.speedups import check_names as check_speedups
from ngrpo_lightning.checks import check_bool, check_choice
from ngrpo_lightning.config import ConfigError
from ngrpo_lightning.models import lora
from ngrpo_lightning.models.loading import parse_dtype
from ngrpo_lightning.training.module import RLModule
from ngrpo_lightning.training.parallel import ParallelConfig


def check_model_settings(cfg: DictConfig) -> None:
    """``backend.*``, ``model.*`` memory settings, ``model.lora``: checked before a model loads (after ``optim.*``)."""
    check_backend_settings(cfg)
    check_memory_settings(cfg)
    lora_settings(cfg)


def check_backend_settings(cfg: DictConfig) -> None:
    """``backend.name`` is a registered backend (or ``auto``), ``backend.attention`` an attention
    transformers knows (or ``auto``), and ``backend.disable`` / ``backend.enable`` name its speed-ups."""
    node = cfg.get("backend") or {}
    try:
        cls = backend_class(node.get("name", "auto"), str((cfg.get("trainer") or {}).get("accelerator", "auto")))
        choice = node.get("attention", "auto")
        if choice != "auto":
            attention.check_attn_implementation(choice, "backend.attention")
        packing = node.get("packing", "auto")
        check_choice("backend.packing", {True: "on", False: "off"}.get(packing, packing), ("auto", "on", "off"))
        for key in ("disable", "enable"):
            check_speedups(node.get(key), f"backend.{key}", cls.device_type, cls.speedups)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def speedup_settings(cfg: DictConfig) -> dict:
    """``disable`` and ``enable`` from ``backend.*`` (deprecated ``backend.packing`` off read as
    ``disable=[packed_products]``; ``trainer.deterministic`` turns off what a timing decides)."""
    node = cfg.get("backend") or {}
    disable, enable = list(node.get("disable") or ()), list(node.get("enable") or ())
    packing = {True: "on", False: "off"}.get(node.get("packing", "auto"), node.get("packing", "auto"))
    if packing != "auto":
        warnings.warn(
            f"backend.packing={packing} is deprecated: use backend.disable=[packed_products] to leave packing off",
            DeprecationWarning,
            stacklevel=2,
        )
    if packing == "off" or (cfg.get("trainer") or {}).get("deterministic") is True:
        disable.append("packed_products")  # bit for bit: no choice that depends on a timing
    return {"disable": list(dict.fromkeys(disable)), "enable": enable, "packing": "on" if packing == "on" else "auto"}


def build_backend(cfg: DictConfig) -> Backend:
    """The run's backend (``backend.name``; ``auto``: by ``trainer.accelerator``) for the model's dtype and shapes."""
    d, r = cfg.data, cfg.rollout
    rows = d.prompts_per_step * r.group_size
    optim = cfg.get("optim") or {}
    micro_rows = optim.get("micro_batch_size") or rows
    tokens = micro_rows * (min(d.max_prompt_tokens, 256) + r.max_new_tokens)  # prompts are rarely near their cap
    budget = optim.get("max_tokens_per_micro_batch")
    train_rows = min(tokens, budget) if budget else tokens
    return backend_for_config(cfg, str(cfg.trainer.get("accelerator", "auto")), decode_rows=rows, train_rows=train_rows)


def backend_for_config(cfg: DictConfig, accelerator: str, **shapes) -> Backend:
    """The backend ``backend.*`` asks for, for ``model.dtype`` on ``accelerator``, checked; ``shapes``:
    the usual rows of its products (``decode_rows``, ``train_rows``)."""
    check_backend_settings(cfg)
    node = cfg.get("backend") or {}
    settings = speedup_settings(cfg)
    try:
        return select_backend(
            node.get("name", "auto"),
            parse_dtype(cfg.model.dtype),
            accelerator,
            attention=node.get("attention", "auto"),
            **settings,
            **shapes,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from err


def prepare_models(cfg: DictConfig, policy: torch.nn.Module, needs_reference: bool, backend: Backend | None = None):
    """``(policy, reference, adapters)``: with ``model.lora`` the policy gets adapters and the reference is ``None``
    (the policy with them off); otherwise a frozen copy, in memory or in a file. Then activation checkpointing, and
    the backend swaps both models' modules (:meth:`~ngrpo_lightning.backends.Backend.prepare`)."""
    backend = backend or build_backend(cfg)
    lora_cfg = lora_settings(cfg)
    sharded = parallel_config(cfg) is not None
    reference = None
    if lora_cfg.enabled:  # the reference is the policy with its adapters off: no second copy
        try:
            policy = lora.apply(policy, lora_cfg)
        except ValueError as err:  # target modules the model does not have
            raise ConfigError(str(err)) from err
    elif needs_reference and backend.reference_in_file(cfg.get("output_dir"), sharded):  # in a file between steps
        reference = file_weights.frozen_copy_to_file(policy, cfg.output_dir)
    elif needs_reference:
        reference = RLModule.reference_from(policy)
    if cfg.model.get("gradient_checkpointing", False):  # after the copy: the frozen reference never runs backward
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    backend.prepare(policy, trains=True, sharded=sharded)
    if reference is not None:
        backend.prepare(reference, sharded=sharded)
    return policy, reference, lora_cfg.enabled


def check_memory_settings(cfg: DictConfig) -> None:
    """A token budget must hold the longest sequence; activation checkpointing is
    ``model.gradient_checkpointing`` on one device, ``trainer.parallel.activation_checkpointing`` under FSDP2."""
    budget = (cfg.get("optim") or {}).get("max_tokens_per_micro_batch")  # its type checked by OptimConfig first
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if budget is not None and budget < longest:
        raise ConfigError(
            f"optim.max_tokens_per_micro_batch={budget} is smaller than the "
            f"longest possible sequence, {longest} tokens (data.max_prompt_tokens="
            f"{cfg.data.max_prompt_tokens} + rollout.max_new_tokens={cfg.rollout.max_new_tokens}): "
            f"raise it to at least {longest}, or set it to null"
        )
    checkpointing = cfg.model.get("gradient_checkpointing", False)
    check_bool("model.gradient_checkpointing", checkpointing, ConfigError)
    if checkpointing and parallel_config(cfg) is not None:
        raise ConfigError(
            "model.gradient_checkpointing=true is for one device; under FSDP2 (trainer.parallel) set "
            "trainer.parallel.activation_checkpointing=true instead"
        )


def lora_settings(cfg: DictConfig) -> lora.LoraSettings:
    """``model.lora``, checked."""
    try:
        settings = lora.LoraSettings.from_config(cfg.model.get("lora"))
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from err
    return settings


def parallel_config(cfg: DictConfig):
    """``trainer.parallel`` as a :class:`~ngrpo_lightning.training.parallel.ParallelConfig` (``None`` when absent)."""
    node = (cfg.get("trainer") or {}).get("parallel")
    if not node:
        return None
    params = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    try:
        return ParallelConfig(**params)
    except TypeError as err:
        raise ConfigError(
            f"trainer.parallel: {err} (keys: name, data_parallel_size, activation_checkpointing, "
            "cpu_offload, mixed_precision)"
        ) from err
    except ValueError as err:
        raise ConfigError(str(err)) from err
