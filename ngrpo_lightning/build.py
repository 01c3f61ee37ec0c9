"""From a composed config to the objects of a run.

Each ``build_*`` function turns one config group into one object and fails with an
error naming the offending key. The CLI, the tests and user scripts share them.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from .explorers import EXPLORERS, Explorer, TemperatureExplorer
from .objectives import OBJECTIVES, PolicyObjective


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key."""


# ------------------------------------------------------------------ components
def instantiate_component(cfg: DictConfig | dict, registry: dict, group: str):
    """Build an explorer/objective from ``{name: ..., **kwargs}`` or ``{_target_: class.path, **kwargs}``."""
    params = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    target, name = params.pop("_target_", None), params.pop("name", None)
    if target:
        from hydra.utils import get_class

        try:
            cls = get_class(target)
        except Exception as err:  # ImportError, AttributeError, ValueError from hydra
            raise ConfigError(f"{group}._target_={target!r} cannot be imported: {err}") from err
    elif name in registry:
        cls = registry[name]
    else:
        raise ConfigError(f"{group}.name={name!r} is unknown: allowed {sorted(registry)} (or set {group}._target_=<class path>)")
    sig = inspect.signature(cls.__init__)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    allowed = [p for p in sig.parameters if p not in ("self",) and sig.parameters[p].kind is not inspect.Parameter.VAR_KEYWORD]
    unknown = [k for k in params if k not in allowed]
    if unknown and not takes_any:
        raise ConfigError(f"{group}.{unknown[0]} is not a parameter of {cls.__name__}: allowed {allowed}")
    try:
        return cls(**params)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{group} ({cls.__name__}): {err}") from err


def build_explorer(cfg: DictConfig) -> Explorer:
    explorer = instantiate_component(cfg, EXPLORERS, "explorer")
    if not isinstance(explorer, Explorer):
        raise ConfigError(f"explorer._target_ must name a subclass of ngrpo_lightning.explorers.Explorer, got {type(explorer).__name__}")
    return explorer


def build_objective(cfg: DictConfig) -> PolicyObjective:
    objective = instantiate_component(cfg, OBJECTIVES, "objective")
    if not isinstance(objective, PolicyObjective):
        raise ConfigError(f"objective._target_ must name a subclass of ngrpo_lightning.objectives.PolicyObjective, got {type(objective).__name__}")
    return objective


def build_reward(cfg: DictConfig):
    from .rewards import MathReward

    return MathReward(extract=cfg.extract, timeout_s=cfg.timeout_s, num_workers=cfg.num_workers)


# ------------------------------------------------------------------------ data
def build_problems(cfg: DictConfig, seed: int):
    """(train problems, validation problems) for ``data.source``; data errors become
    :class:`ConfigError` (they already name the file, line and field)."""
    try:
        return _problems(cfg, seed)
    except (ValueError, KeyError) as err:
        raise ConfigError(str(err).strip('"')) from err


def _problems(cfg: DictConfig, seed: int):
    from .data import ArithmeticTask, load_problems

    if cfg.source == "arithmetic":
        knobs = {k: cfg[k] for k in ("min_operand", "max_operand", "min_ops", "max_ops")}
        knobs["operators"] = tuple(cfg.operators)
        train = ArithmeticTask(num_problems=cfg.train_size, seed=seed, split="train", **knobs).problems()
        val = ArithmeticTask(num_problems=cfg.val_size, seed=seed, split="validation", **knobs).problems() if cfg.val_size else []
        return train, val
    if cfg.source == "files":
        fields = {"problem_field": cfg.problem_field, "answer_field": cfg.answer_field, "id_field": cfg.id_field}
        train = load_problems(cfg.train, split=cfg.split, limit=cfg.limit, **fields)
        val = load_problems(cfg.val, split=cfg.val_split, limit=cfg.val_limit, **fields) if cfg.val else []
        return train, val
    raise ConfigError(f"data.source={cfg.source!r} is unknown: allowed ['arithmetic', 'files']")


def build_datamodule(cfg: DictConfig, tokenizer, problems=None):
    """The rollout DataModule; ``problems`` = (train, val) if already built."""
    from .rollout import RolloutDataModule

    train, val = problems or build_problems(cfg.data, cfg.seed)
    r = cfg.rollout
    return RolloutDataModule(
        tokenizer, train, val,
        prompts_per_step=cfg.data.prompts_per_step, group_size=r.group_size, max_new_tokens=r.max_new_tokens,
        max_prompt_tokens=cfg.data.max_prompt_tokens, val_samples=r.val_samples, val_batch_size=r.val_batch_size,
        engine=r.engine, engine_kwargs=engine_kwargs(cfg), instruction=cfg.data.instruction,
        system_prompt=cfg.data.system_prompt, seed=cfg.seed,
    )


def engine_kwargs(cfg: DictConfig) -> dict:
    """The engine's settings: ``rollout.vllm.*`` for ``rollout.engine=vllm`` (nulls dropped)."""
    if cfg.rollout.engine != "vllm":
        return {}
    settings = {k: v for k, v in OmegaConf.to_container(cfg.rollout.get("vllm") or {}, resolve=True).items() if v is not None}
    settings.setdefault("max_model_len", cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)
    return settings


def check_engine(cfg: DictConfig) -> None:
    """``rollout.engine=vllm`` without a supported vLLM fails before any model loading."""
    from .rollout.datamodule import ENGINES

    if cfg.rollout.engine not in ENGINES:
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r} is unknown: allowed {list(ENGINES)}")
    if cfg.rollout.engine == "vllm":
        from .rollout.vllm_support import VLLMVersionError, check_vllm

        try:
            check_vllm()
        except VLLMVersionError as err:
            raise ConfigError(str(err)) from err


# ---------------------------------------------------------------------- module
def build_module(cfg: DictConfig):
    """The policy (and reference) models, explorer, objective and reward, as an RLModule."""
    from .models import load_policy, parse_dtype
    from .module import OptimConfig, RLModule

    explorer, objective = build_explorer(cfg.explorer), build_objective(cfg.objective)
    build_callbacks(cfg)  # bad train.* / replay.* values fail here, before minutes of model loading
    try:
        parse_dtype(cfg.model.dtype)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    policy, tokenizer = load_policy(cfg.model.name_or_path, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    reference = RLModule.reference_from(policy) if objective.needs_reference else None
    optim = OptimConfig(**OmegaConf.to_container(cfg.optim, resolve=True))
    eval_explorer = TemperatureExplorer(temperature=cfg.rollout.val_temperature)
    train = cfg.get("train") or {}
    try:
        return RLModule(policy, tokenizer, explorer, objective, build_reward(cfg.reward), reference=reference, optim=optim,
                        advantage=cfg.advantage, eval_explorer=eval_explorer, detach_mixture=cfg.detach_mixture,
                        dynamic_sampling=train.get("dynamic_sampling", False),
                        max_extra_rollouts=train.get("max_extra_rollouts", 4), parallel=parallel_config(cfg),
                        tis_cap=train.get("tis_cap"))
    except ValueError as err:
        raise ConfigError(str(err)) from err


def build_callbacks(cfg: DictConfig) -> list[L.Callback]:
    """Training callbacks the config asks for: a ``ReplayBuffer`` when a step makes more
    than one update (``train.ppo_epochs``, ``train.num_mini_batches``) or replays past
    successes (``replay.capacity`` > 0)."""
    from callbacks import ReplayBuffer

    train, replay = cfg.get("train") or {}, cfg.get("replay") or {}
    epochs, minis, capacity = train.get("ppo_epochs", 1), train.get("num_mini_batches", 1), replay.get("capacity", 0)
    try:
        buffer = ReplayBuffer(ppo_epochs=epochs, num_mini_batches=minis, capacity=capacity,
                              max_staleness=replay.get("max_staleness", 4), is_cap=replay.get("is_cap", 2.0), seed=cfg.seed)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return [buffer] if epochs * minis > 1 or capacity else []


def build_pass_at_k(cfg: DictConfig, val_problems) -> list[L.Callback]:
    """``callbacks.PassAtK`` on the run's validation problems when ``pass_at_k.n`` > 0."""
    opts = cfg.get("pass_at_k") or {}
    if not opts.get("n") or not val_problems:
        return []
    from callbacks import PassAtK

    from .evaluate import EvalSet

    d = cfg.data
    name = d.get("name") or d.source
    evalset = EvalSet(name, list(val_problems), instruction=d.instruction, system_prompt=d.system_prompt,
                      answer_format=d.answer_format, max_prompt_tokens=d.max_prompt_tokens)
    try:
        return [PassAtK([evalset], n=opts.n, every_n_steps=opts.every_n_steps, temperature=opts.temperature,
                        top_p=opts.top_p, max_new_tokens=opts.max_new_tokens, batch_size=opts.batch_size, seed=cfg.seed)]
    except ValueError as err:
        raise ConfigError(f"pass_at_k: {err}") from err


# --------------------------------------------------------------------- logging
def resolve_tracking_uri(uri: str) -> str:
    """Make a relative ``sqlite:///`` store absolute and create its folder."""
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        path = Path(uri[len(prefix):])
        path = path if path.is_absolute() else Path.cwd() / path
        path.parent.mkdir(parents=True, exist_ok=True)
        return prefix + str(path)
    return uri


def build_logger(cfg: DictConfig, run_id: str | None = None):
    """The MLflow logger; ``run_id`` continues an existing run (resume)."""
    if cfg.logger.name == "none":
        return None
    if cfg.logger.name != "mlflow":
        raise ConfigError(f"logger.name={cfg.logger.name!r} is unknown: allowed ['mlflow', 'none']")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from lightning.pytorch.loggers import MLFlowLogger

    uri = resolve_tracking_uri(cfg.logger.tracking_uri)
    artifacts = cfg.logger.artifact_location
    if artifacts is None and uri.startswith("sqlite:///"):
        artifacts = (Path(uri[len("sqlite:///"):]).parent / "artifacts").as_uri()
    return MLFlowLogger(experiment_name=cfg.experiment_name, run_name=cfg.logger.run_name, tracking_uri=uri,
                        artifact_location=artifacts, log_model=False, run_id=run_id)


# ------------------------------------------------------------------- trainer
def parallel_config(cfg: DictConfig):
    """``trainer.parallel`` as a :class:`~ngrpo_lightning.parallel.ParallelConfig` (``None`` when absent)."""
    from .parallel import ParallelConfig

    node = (cfg.get("trainer") or {}).get("parallel")
    if not node:
        return None
    params = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    try:
        return ParallelConfig(**params)
    except TypeError as err:
        raise ConfigError(f"trainer.parallel: {err} (keys: name, data_parallel_size, activation_checkpointing, "
                          "cpu_offload, mixed_precision)") from err
    except ValueError as err:
        raise ConfigError(str(err)) from err


def check_trainer(cfg: DictConfig) -> None:
    """Fail early (before model loading) on a trainer the machine cannot run."""
    trainer = cfg.trainer
    accelerator = str(trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            hint = ("trainer=fsdp_cpu runs FSDP2 with 2 processes on CPU (gloo)" if trainer.get("parallel")
                    else "use trainer=cpu")
            raise ConfigError(f"trainer.accelerator={accelerator} but this machine has no CUDA GPU: {hint}")
    parallel = parallel_config(cfg)
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1) or 1
    several = parallel is not None or (isinstance(devices, int) and devices > 1) or nodes > 1
    if several and (cfg.get("train") or {}).get("dynamic_sampling", False):
        raise ConfigError("train.dynamic_sampling=true is not supported with several processes yet "
                          "(use one process, e.g. trainer=cpu or trainer=gpu, or train.dynamic_sampling=false)")
    if parallel is not None and parallel.cpu_offload and accelerator == "cpu":
        raise ConfigError("trainer.parallel.cpu_offload=true moves GPU state to host memory; with trainer.accelerator=cpu "
                          "everything is in host memory already: set trainer.parallel.cpu_offload=false")


def build_strategy(cfg: DictConfig):
    """``ModelParallelStrategy`` (FSDP2; the module's ``configure_model`` shards) for a
    ``trainer.parallel`` block, else ``None`` (Lightning's default for ``trainer.strategy``)."""
    parallel = parallel_config(cfg)
    if parallel is None:
        return None
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=parallel.data_parallel_size, tensor_parallel_size=1,
                                 save_distributed_checkpoint=True)


def checkpoint_dir(cfg: DictConfig) -> Path:
    return Path(cfg.output_dir) / "checkpoints"


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also checkpoints the final step when training ends
    (``max_steps`` is rarely a multiple of ``every_n_train_steps``): a step checkpoint that
    ``last`` links to, or ``last`` itself when no step checkpoints are kept."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        # Lightning sends a step's metrics to the loggers after on_train_batch_end: a process
        # killed right after this checkpoint would lose them (the resumed run starts after
        # the step). Send them first; the loop's own send of the same step is then dropped.
        every = self._every_n_train_steps
        if every and trainer.global_step % every == 0 and not self._should_skip_saving_checkpoint(trainer) and trainer.loggers:
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            trainer._logger_connector.update_train_step_metrics()
            for logger in trainer.loggers:
                _drop_next_log_of_step(logger, step)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self.save_last and self._last_global_step_saved != trainer.global_step and not trainer.sanity_checking:
            candidates = self._monitor_candidates(trainer)
            if self.save_top_k != 0:
                self._save_topk_checkpoint(trainer, candidates)  # last links to it
            self._save_last_checkpoint(trainer, candidates)


def _drop_next_log_of_step(logger, step: int) -> None:
    """Make ``logger`` ignore its next ``log_metrics`` call if it is for ``step`` (already sent)."""
    original = logger.log_metrics

    def once(metrics, step_=None, **kwargs):
        logger.log_metrics = original  # one call only
        given = kwargs.get("step", step_)
        if given != step:
            original(metrics, given)

    logger.log_metrics = once


def build_checkpointing(cfg: DictConfig) -> list[L.Callback]:
    """Checkpoints in ``<output_dir>/checkpoints``: ``step-<n>.ckpt`` every
    ``checkpoint.every_n_steps`` optimizer steps (0: none) and ``last.ckpt`` (also at the
    end of training), which ``resume=last`` reads; ``checkpoint.keep`` step checkpoints are kept."""
    if not cfg.trainer.get("enable_checkpointing", True):
        return []
    node = cfg.get("checkpoint") or {}
    every, keep = int(node.get("every_n_steps", 0) or 0), int(node.get("keep", -1))
    # last.ckpt links to the newest step checkpoint when there is one (no second copy on disk)
    return [RunCheckpoint(dirpath=str(checkpoint_dir(cfg)), filename="step-{step}", save_last="link",
                          save_top_k=keep if every else 0, every_n_train_steps=every or None,
                          save_on_train_epoch_end=False, enable_version_counter=False)]


def resolve_resume(cfg: DictConfig) -> str | None:
    """The checkpoint ``resume`` names: ``null`` (none), ``last`` (``<output_dir>/checkpoints/last.ckpt``)
    or a path (a ``.ckpt`` file, or the folder of a distributed checkpoint)."""
    resume = cfg.get("resume")
    if resume in (None, "", False):
        return None
    path = checkpoint_dir(cfg) / "last.ckpt" if str(resume) == "last" else Path(str(resume))
    if not path.exists():
        where = f" (resume=last reads {path}: checkpoints of output_dir={cfg.output_dir})" if str(resume) == "last" else ""
        raise ConfigError(f"resume={resume}: no checkpoint at {path}{where}")
    return str(path)


def checkpoint_meta(path: str) -> dict:
    """What the module stored about the run (``ngrpo``: config, MLflow run id) in a checkpoint
    file or a distributed checkpoint folder, without loading weights into a model."""
    import torch

    file = Path(path) / "meta.pt" if Path(path).is_dir() else Path(path)
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=False, mmap=not Path(path).is_dir())
    except Exception as err:  # noqa: BLE001 - any unreadable file is a config error here
        raise ConfigError(f"resume: cannot read the checkpoint {path}: {err}") from err
    return ckpt.get("ngrpo") or {}


def check_resume(cfg: DictConfig, meta: dict) -> None:
    """A checkpoint of a different model or config cannot be resumed: the error names the key."""
    from .checkpointing import config_mismatch

    saved = meta.get("config")
    if saved is None:
        return
    problem = config_mismatch(saved, OmegaConf.to_container(cfg, resolve=True))
    if problem:
        raise ConfigError(f"resume={cfg.resume}: the checkpoint is of a different run: {problem}")


def build_trainer(cfg: DictConfig, logger=None, callbacks=()):
    from lightning.pytorch.callbacks import LearningRateMonitor

    from callbacks import RolloutSamplesLogger

    check_trainer(cfg)
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    kwargs.pop("parallel", None)
    strategy = build_strategy(cfg)
    if strategy is not None:
        kwargs["strategy"] = strategy
    kwargs.setdefault("use_distributed_sampler", False)  # the datamodule splits prompts by rank itself
    cbs = list(callbacks) + build_callbacks(cfg)
    if not any(type(cb).__name__ == "ModelCheckpoint" for cb in cbs):
        cbs += build_checkpointing(cfg)
    if logger is not None:
        cbs.append(LearningRateMonitor(logging_interval="step"))
        if cfg.logger.log_samples_every:
            cbs.append(RolloutSamplesLogger(every_n_steps=cfg.logger.log_samples_every, num_samples=cfg.logger.num_samples))
    try:
        return L.Trainer(logger=logger if logger is not None else False, callbacks=cbs, default_root_dir=cfg.output_dir, **kwargs)
    except TypeError as err:
        raise ConfigError(f"trainer: {err} (trainer.* keys are lightning.Trainer arguments, plus trainer.parallel)") from err
