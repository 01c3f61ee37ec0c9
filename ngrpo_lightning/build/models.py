"""Building the models of a run: the backend that decides how they compute, the policy's
adapters, the frozen reference, activation checkpointing (``backend.*``, ``model.*``), with their
checks; and ``trainer.parallel`` (FSDP2), which decides some of them."""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

from ngrpo_lightning.backends import Backend, attention, backend_class, file_weights, select_backend
from ngrpo_lightning.checks import check_bool, check_choice
from ngrpo_lightning.config import ConfigError
from ngrpo_lightning.models import lora
from ngrpo_lightning.models.loading import parse_dtype
from ngrpo_lightning.training.module import RLModule
from ngrpo_lightning.training.parallel import ParallelConfig


def check_model_settings(cfg: DictConfig) -> None:
    """``backend.*``, ``model.*`` memory settings and ``model.lora``, checked before any model
    loads (``optim.*`` already checked)."""
    check_backend_settings(cfg)
    check_memory_settings(cfg)
    lora_settings(cfg)


def check_backend_settings(cfg: DictConfig) -> None:
    """``backend.name`` is a registered backend (or ``auto``) and ``backend.attention`` an attention
    transformers knows (or ``auto``)."""
    node = cfg.get("backend") or {}
    try:
        name = node.get("name", "auto")
        if name != "auto":
            backend_class(name, str((cfg.get("trainer") or {}).get("accelerator", "auto")))
        choice = node.get("attention", "auto")
        if choice != "auto":
            attention.check_attn_implementation(choice, "backend.attention")
        packing = node.get("packing", "auto")
        check_choice("backend.packing", {True: "on", False: "off"}.get(packing, packing), ("auto", "on", "off"))
    except ValueError as err:
        raise ConfigError(str(err)) from err


def build_backend(cfg: DictConfig) -> Backend:
    """The run's backend: ``backend.name`` (``auto``: from ``trainer.accelerator``), for the
    model's dtype and the run's usual shapes (a decoding step's rows, a training forward's tokens)."""
    d, r = cfg.data, cfg.rollout
    rows = d.prompts_per_step * r.group_size
    optim = cfg.get("optim") or {}
    micro_rows = optim.get("micro_batch_size") or rows
    tokens = micro_rows * (min(d.max_prompt_tokens, 256) + r.max_new_tokens)  # prompts are rarely near their cap
    budget = optim.get("max_tokens_per_micro_batch")
    train_rows = min(tokens, budget) if budget else tokens
    return backend_for_config(cfg, str(cfg.trainer.get("accelerator", "auto")), decode_rows=rows, train_rows=train_rows)


def backend_for_config(cfg: DictConfig, accelerator: str, **shapes) -> Backend:
    """The backend ``backend.*`` asks for, for ``model.dtype`` on ``accelerator``, checked (every
    command that loads a model: ``ngrpo train``, ``eval``, ``diagnose``); ``shapes``: the usual
    rows of its products (``decode_rows``, ``train_rows``)."""
    check_backend_settings(cfg)
    node = cfg.get("backend") or {}
    packing = node.get("packing", "auto")
    if packing == "auto" and (cfg.get("trainer") or {}).get("deterministic") is True:
        packing = "off"  # bit for bit: no choice that depends on a timing (docs/reliability.md)
    try:
        return select_backend(
            node.get("name", "auto"),
            parse_dtype(cfg.model.dtype),
            accelerator,
            attention=node.get("attention", "auto"),
            packing=packing,
            **shapes,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from err


def prepare_models(cfg: DictConfig, policy: torch.nn.Module, needs_reference: bool, backend: Backend | None = None):
    """``(policy, reference, adapters)`` from the loaded ``policy``: with ``model.lora`` the
    policy gets adapters and the reference is the policy with them off (``None`` here,
    ``adapters`` true); otherwise the reference is a frozen copy, in memory or in a file (the
    backend's choice). Then activation checkpointing, and the backend swaps both models'
    modules once (:meth:`~ngrpo_lightning.backends.Backend.prepare`)."""
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
    """A token budget must hold the longest possible sequence; activation checkpointing is
    ``model.gradient_checkpointing`` on one device and ``trainer.parallel.activation_checkpointing``
    under FSDP2."""
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
