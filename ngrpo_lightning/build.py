"""From a composed config to the objects of a run.

Each ``build_*`` function turns one config group into one object and fails with an
error naming the offending key. The CLI, the tests and user scripts share them.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import lightning as L
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
        engine=r.engine, instruction=cfg.data.instruction, system_prompt=cfg.data.system_prompt, seed=cfg.seed,
    )


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
                        max_extra_rollouts=train.get("max_extra_rollouts", 4))
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


def build_logger(cfg: DictConfig):
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
                        artifact_location=artifacts, log_model=False)


def build_trainer(cfg: DictConfig, logger=None, callbacks=()):
    from lightning.pytorch.callbacks import LearningRateMonitor

    from callbacks import RolloutSamplesLogger

    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    cbs = list(callbacks) + build_callbacks(cfg)
    if logger is not None:
        cbs.append(LearningRateMonitor(logging_interval="step"))
        if cfg.logger.log_samples_every:
            cbs.append(RolloutSamplesLogger(every_n_steps=cfg.logger.log_samples_every, num_samples=cfg.logger.num_samples))
    try:
        return L.Trainer(logger=logger if logger is not None else False, callbacks=cbs, default_root_dir=cfg.output_dir, **kwargs)
    except TypeError as err:
        raise ConfigError(f"trainer: {err} (trainer.* keys are lightning.Trainer arguments)") from err
