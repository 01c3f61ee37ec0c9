"""Building the models of a run: the policy's adapters, where the frozen reference lives, and
how the policy's activations are kept for backward (``model.*``), with their checks; and
``trainer.parallel`` (FSDP2), which decides some of them."""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

from . import file_weights, lora, recompute
from .config import ConfigError
from .module import RLModule
from .parallel import ParallelConfig


def check_model_settings(cfg: DictConfig) -> None:
    """``model.*`` memory settings, ``model.reference_weights`` and ``model.lora``, checked
    before any model loads (``optim.*`` already checked)."""
    check_memory_settings(cfg)
    reference_weights(cfg)
    lora_settings(cfg)


def prepare_models(cfg: DictConfig, policy: torch.nn.Module, needs_reference: bool):
    """``(policy, reference, adapters)`` from the loaded ``policy``: with ``model.lora`` the
    policy gets adapters and the reference is the policy with them off (``None`` here,
    ``adapters`` true); otherwise the reference is a frozen copy, in memory or in a file
    (``model.reference_weights``). Then activation checkpointing or elementwise recompute."""
    lora_cfg = lora_settings(cfg)
    reference = None
    if lora_cfg.enabled:  # the reference is the policy with its adapters off: no second copy
        try:
            policy = lora.apply(policy, lora_cfg)
        except ValueError as err:  # target modules the model does not have
            raise ConfigError(str(err)) from err
    elif needs_reference and reference_weights(cfg) == "file":  # in a file between steps
        reference = file_weights.frozen_copy_to_file(policy, cfg.output_dir)
    elif needs_reference:
        reference = RLModule.reference_from(policy)
    if cfg.model.get("gradient_checkpointing", False):  # after the copy: the frozen reference never runs backward
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif cfg.model.get("recompute_elementwise", True):  # checkpointed layers recompute everything anyway
        recompute.install(policy, up_proj=cfg.model.get("recompute_up_proj", True))
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
    for key in ("gradient_checkpointing", "recompute_elementwise", "recompute_up_proj"):
        value = cfg.model.get(key, False)
        if not isinstance(value, bool):
            raise ConfigError(f"model.{key}={value!r} must be true or false")
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


def reference_weights(cfg: DictConfig) -> str:
    """Where the frozen reference's weights live, ``memory`` or ``file`` (``model.reference_weights``)."""
    choice = cfg.model.get("reference_weights", "auto")
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    try:
        return file_weights.resolve(choice, accelerator, parallel_config(cfg) is not None, cfg.get("output_dir"))
    except ValueError as err:
        raise ConfigError(str(err)) from err


def parallel_config(cfg: DictConfig):
    """``trainer.parallel`` as a :class:`~ngrpo_lightning.parallel.ParallelConfig` (``None`` when absent)."""
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
