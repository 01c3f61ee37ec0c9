"""The Trainer of a run: process count, checks of ``trainer.*`` and the settings depending on it, FSDP2, callbacks."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.callbacks import LearningRateMonitor, ProgressBar
from omegaconf import DictConfig, OmegaConf

from ngrpo_lightning.build.models import parallel_config
from ngrpo_lightning.callbacks import RolloutSamplesLogger, UpdateMemoryCheck
from ngrpo_lightning.checkpoints.io import AtomicModelParallelStrategy, checkpoint_io
from ngrpo_lightning.checkpoints.run import build_checkpointing
from ngrpo_lightning.checks import check_bool, check_choice
from ngrpo_lightning.config import ConfigError
from ngrpo_lightning.tracking.console import StepProgressBar
from ngrpo_lightning.training.interrupt import StopOnInterrupt

__all__ = ["build_trainer", "check_trainer", "process_count", "processes_per_node", "trainer_kwargs"]


def process_count(cfg: DictConfig) -> int:
    """The processes the Trainer starts: ``trainer.devices`` (as Lightning reads it) x ``trainer.num_nodes``."""
    trainer = cfg.trainer
    devices, nodes = trainer.get("devices", 1), int(trainer.get("num_nodes", 1) or 1)
    gpu = str(trainer.get("accelerator", "auto")) in ("gpu", "cuda") or (
        str(trainer.get("accelerator", "auto")) == "auto" and torch.cuda.is_available()
    )
    if isinstance(devices, str) and devices not in ("auto", "-1"):
        devices = [d for d in devices.split(",") if d.strip()]
    if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        count = len(devices)
    elif devices in ("auto", "-1", -1):
        count = torch.cuda.device_count() if gpu else 1
    else:
        count = int(devices)
    processes = count * nodes
    return max(processes, 2) if parallel_config(cfg) is not None else processes


def processes_per_node(cfg: DictConfig) -> int:
    """The processes the Trainer starts on each node (:func:`process_count` over ``trainer.num_nodes``)."""
    return max(1, process_count(cfg) // int(cfg.trainer.get("num_nodes", 1) or 1))


def check_trainer(cfg: DictConfig) -> None:
    """Fail early (before model loading) on a trainer the machine cannot run."""
    trainer = cfg.trainer
    accelerator = str(trainer.get("accelerator", "auto"))
    try:  # Lightning's names, checked here rather than from deep inside the Trainer
        check_choice("trainer.accelerator", accelerator, {*AcceleratorRegistry.available_accelerators(), "auto", "gpu"})
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            hint = (
                "trainer=fsdp_cpu runs FSDP2 with 2 processes on CPU (gloo)"
                if trainer.get("parallel")
                else "use trainer=cpu"
            )
            raise ConfigError(f"trainer.accelerator={accelerator} but this machine has no CUDA GPU: {hint}")
    parallel = parallel_config(cfg)
    strategy, count = trainer.get("strategy"), process_count(cfg)
    if parallel is None and (count > 1 or strategy not in (None, "auto", "single_device")):
        # Lightning would start DDP; the module shards and agrees over ranks through FSDP2 only
        asked = (
            f"trainer.strategy={strategy} without trainer.parallel"
            if strategy not in (None, "auto")
            else f"trainer.devices={trainer.get('devices')} ({count} processes) without trainer.parallel would run "
            "Lightning's DDP"
        )
        route = "trainer=fsdp_cpu" if accelerator == "cpu" else f"trainer=fsdp trainer.devices={max(count, 2)}"
        raise ConfigError(
            f"{asked}: this framework trains over several processes with FSDP2 only (docs/distributed.md); use {route}"
        )
    if parallel is not None and parallel.cpu_offload and accelerator == "cpu":
        raise ConfigError(
            "trainer.parallel.cpu_offload=true moves GPU state to host memory; with trainer.accelerator=cpu "
            "everything is in host memory already: set trainer.parallel.cpu_offload=false"
        )


def check_export(cfg: DictConfig) -> None:
    """``export.final`` is true or false; under FSDP2 it exports the last checkpoint, so it needs one."""
    node = cfg.get("export") or {}
    check_bool("export.final", node.get("final", False), ConfigError)
    if node.get("final") and parallel_config(cfg) is not None and not cfg.trainer.get("enable_checkpointing", True):
        raise ConfigError(
            "export.final=true under FSDP2 exports the last checkpoint, but trainer.enable_checkpointing=false: "
            "turn checkpointing on, or export.final=false"
        )


def check_async_save(cfg: DictConfig) -> bool:
    """``checkpoint.async_save``: write checkpoints in a background thread (true or false)."""
    value = (cfg.get("checkpoint") or {}).get("async_save", False)
    return check_bool("checkpoint.async_save", value, ConfigError)


def build_strategy(cfg: DictConfig):
    """``ModelParallelStrategy`` (FSDP2) for a ``trainer.parallel`` block, else ``None``."""
    parallel = parallel_config(cfg)
    if parallel is None:
        return None
    return AtomicModelParallelStrategy(
        data_parallel_size=parallel.data_parallel_size, tensor_parallel_size=1, save_distributed_checkpoint=True
    )


def build_trainer(cfg: DictConfig, logger=None, callbacks=()) -> L.Trainer:
    """The run's ``lightning.Trainer``: :func:`trainer_kwargs` given to it."""
    kwargs = trainer_kwargs(cfg, logger, callbacks)
    try:
        return L.Trainer(**kwargs)
    except TypeError as err:
        raise ConfigError(
            f"trainer: {err} (trainer.* keys are lightning.Trainer arguments, plus trainer.parallel)"
        ) from err


def trainer_kwargs(cfg: DictConfig, logger=None, callbacks=()) -> dict:
    """The arguments of the run's ``lightning.Trainer``, as ``ngrpo train`` gives them: ``trainer.*``,
    the FSDP2 strategy, the checkpoint writer, and the run's callbacks beside ``callbacks``."""
    check_trainer(cfg)
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    kwargs.pop("parallel", None)
    strategy = build_strategy(cfg)
    io = checkpoint_io(async_save=check_async_save(cfg))  # streamed to disk, atomic (checkpoint_io.py)
    if strategy is not None:
        strategy.checkpoint_io = io
        kwargs["strategy"] = strategy
    else:
        kwargs["plugins"] = [*(kwargs.get("plugins") or []), io]
    kwargs.setdefault("use_distributed_sampler", False)  # the datamodule splits prompts by rank itself
    verbose = bool((cfg.get("logger") or {}).get("verbose", False))
    kwargs.setdefault("enable_model_summary", verbose)  # a table of parameter counts: for those who ask
    cbs = list(callbacks)
    if kwargs.get("enable_progress_bar", True) and not any(isinstance(cb, ProgressBar) for cb in cbs):
        cbs.append(StepProgressBar())
    if not any(type(cb).__name__ == "ModelCheckpoint" for cb in cbs):
        cbs += build_checkpointing(cfg)
    if not any(isinstance(cb, StopOnInterrupt) for cb in cbs):
        cbs.append(StopOnInterrupt())  # the first Ctrl-C stops after the step under way, saved
    if "data" in cfg and not any(isinstance(cb, UpdateMemoryCheck) for cb in cbs):
        new_tokens = cfg.rollout.max_new_tokens
        rows, longest = cfg.data.prompts_per_step * cfg.rollout.group_size, cfg.data.max_prompt_tokens + new_tokens
        cbs.append(UpdateMemoryCheck(rows, new_tokens, longest))
    if logger is not None:
        cbs.append(LearningRateMonitor(logging_interval="step"))
        if cfg.logger.log_samples_every:
            cbs.append(
                RolloutSamplesLogger(every_n_steps=cfg.logger.log_samples_every, num_samples=cfg.logger.num_samples)
            )
    run = {"logger": logger if logger is not None else False, "callbacks": cbs, "default_root_dir": cfg.output_dir}
    return run | kwargs
