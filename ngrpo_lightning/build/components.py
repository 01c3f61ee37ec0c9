"""From a composed config to the objects of a run.

Each ``build_*`` function turns one config group into one object, or an error naming the key. Data, engines:
:mod:`.data`; models: :mod:`.models`; Trainer: :mod:`.trainer`; checkpoints: :mod:`ngrpo_lightning.checkpoints.run`."""

from __future__ import annotations

import inspect

import lightning as L
from omegaconf import DictConfig, OmegaConf

from ngrpo_lightning.build.data import engine_settings
from ngrpo_lightning.build.models import build_backend, check_model_settings, parallel_config, prepare_models
from ngrpo_lightning.build.trainer import build_trainer, check_async_save, check_export, check_trainer
from ngrpo_lightning.callbacks import PassAtK, ReplayBuffer
from ngrpo_lightning.checkpoints.run import build_checkpointing
from ngrpo_lightning.checks import check_bool, check_number, check_seed
from ngrpo_lightning.config import ConfigError, named_error
from ngrpo_lightning.explorers import EXPLORERS, Explorer, TemperatureExplorer, check_explorer
from ngrpo_lightning.metrics.evaluate import EvalSet
from ngrpo_lightning.models.loading import check_context, load_policy, parse_dtype
from ngrpo_lightning.objectives import (
    OBJECTIVES,
    PolicyObjective,
    check_advantage,
    check_objective,
    resolve_advantage,
)
from ngrpo_lightning.registry import import_path
from ngrpo_lightning.rewards import MathReward
from ngrpo_lightning.rollout import check_engine
from ngrpo_lightning.training.module import RLModule
from ngrpo_lightning.training.settings import OptimConfig, ReplayConfig, TrainConfig
from ngrpo_lightning.training.updates import StepHook

__all__ = [
    "build_explorer",
    "build_module",
    "build_objective",
    "build_pass_at_k",
    "build_reward",
    "build_step_hooks",
    "build_trainer",
    "check_config",
    "check_trainer",
]


# ------------------------------------------------------------------ components
def instantiate_component(cfg: DictConfig | dict, registry: dict, group: str):
    """Build an explorer/objective from ``{name: ..., **kwargs}`` or ``{_target_: class.path, **kwargs}``."""
    params = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    target, name = params.pop("_target_", None), params.pop("name", None)
    if target:
        try:
            cls = import_path(target, f"{group}._target_")
        except ValueError as err:
            raise ConfigError(str(err)) from err
        if not isinstance(cls, type):
            raise ConfigError(f"{group}._target_={target!r} is not a class")
    elif name in registry:
        cls = registry[name]
    else:
        raise ConfigError(
            f"{group}.name={name!r} is unknown: allowed {sorted(registry)} (or set {group}._target_=<class path>)"
        )
    sig = inspect.signature(cls.__init__)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    allowed = [
        p for p in sig.parameters if p not in ("self",) and sig.parameters[p].kind is not inspect.Parameter.VAR_KEYWORD
    ]
    unknown = [k for k in params if k not in allowed]
    if unknown and not takes_any:
        raise ConfigError(f"{group}.{unknown[0]} is not a parameter of {cls.__name__}: allowed {allowed}")
    try:
        return cls(**params)
    except (ValueError, TypeError) as err:
        raise named_error(err, group) from err


def build_explorer(cfg: DictConfig) -> Explorer:
    return checked_explorer(instantiate_component(cfg, EXPLORERS, "explorer"))


def checked_explorer(explorer) -> Explorer:
    """``explorer`` (built from a config or by a script), checked before any model loads."""
    if not isinstance(explorer, Explorer):
        raise ConfigError(
            "explorer._target_ must name a subclass of ngrpo_lightning.explorers.Explorer, "
            f"got {type(explorer).__name__}"
        )
    check_temperature(explorer)
    try:  # one step on made-up logits: what it returns, its ids and its mixture weights
        check_explorer(explorer)
    except (ValueError, TypeError, RuntimeError, IndexError) as err:
        raise ConfigError(f"explorer: {err}") from err
    return explorer


def check_temperature(explorer: Explorer) -> None:
    """Refuse an explorer that samples through another (``self.sampler = TemperatureExplorer(0.7)``)
    but keeps the base ``temperature`` 1.0: its log-probs would be recorded at the wrong temperature."""
    if "temperature" in vars(explorer) or type(explorer).temperature != Explorer.temperature:
        return
    inner = [(k, v) for k, v in vars(explorer).items() if isinstance(v, Explorer) and v.temperature != 1.0]
    if inner:
        key, sampler = inner[0]
        raise ConfigError(
            f"{type(explorer).__name__} samples through self.{key} at temperature {sampler.temperature:g} but "
            "leaves its own temperature at the base class's 1.0, at which the engines record the tokens' "
            f"log-probs: set self.temperature = {sampler.temperature:g} in its __init__"
        )


def build_objective(cfg: DictConfig) -> PolicyObjective:
    return checked_objective(instantiate_component(cfg, OBJECTIVES, "objective"))


def checked_objective(objective) -> PolicyObjective:
    """``objective`` (built from a config or by a script), tried on made-up tensors before any model loads."""
    if not isinstance(objective, PolicyObjective):
        raise ConfigError(
            "objective._target_ must name a subclass of ngrpo_lightning.objectives.PolicyObjective, "
            f"got {type(objective).__name__}"
        )
    try:  # run once on made-up tensors: what it returns, and its loss_agg
        check_objective(objective)
    except (ValueError, TypeError, RuntimeError, IndexError) as err:
        raise ConfigError(f"objective: {err}") from err
    return objective


def build_reward(cfg: DictConfig) -> MathReward:
    return MathReward(
        extract=cfg.extract,
        timeout_s=cfg.timeout_s,
        num_workers=cfg.num_workers,
        answer_after=cfg.get("answer_after"),
        graded=cfg.get("graded", False),
    )


# ---------------------------------------------------------------------- module
def settings(cfg: DictConfig) -> tuple[OptimConfig, TrainConfig, ReplayConfig]:
    """``optim.*``, ``train.*`` and ``replay.*`` as validated dataclasses (errors name the key)."""
    out = []
    for key, cls in (("optim", OptimConfig), ("train", TrainConfig), ("replay", ReplayConfig)):
        node = cfg.get(key) or {}
        values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        try:
            out.append(cls(**values))
        except TypeError as err:  # an unknown key (struct mode catches it on the command line; code may not)
            fields = list(cls.__dataclass_fields__)
            raise ConfigError(f"{key}: {err}; the keys of {key} are {fields}") from err
        except ValueError as err:
            raise named_error(err, key) from err
    return tuple(out)


def check_config(cfg: DictConfig) -> None:
    """Build or check every component the config names, without loading a model or data."""
    build_explorer(cfg.explorer), build_objective(cfg.objective)
    try:
        resolve_advantage(cfg.advantage)
    except ValueError as err:
        raise named_error(err, "advantage") from err
    _, train, _ = settings(cfg)
    try:
        train.importance_level(build_objective(cfg.objective))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    check_run_settings(cfg)
    try:  # a user's estimator, run once on made-up rewards: its shape checked before any model loads
        check_advantage(cfg.advantage, cfg.rollout.group_size)
    except (ValueError, TypeError, RuntimeError, IndexError) as err:
        message = str(err) if str(err).startswith("advantage=") else f"advantage={cfg.advantage}: {err}"
        raise ConfigError(message) from err
    build_step_hooks(cfg)
    check_trainer(cfg)
    build_checkpointing(cfg)  # checkpoint.* checked
    check_async_save(cfg)
    check_export(cfg)
    try:  # the engine exists, runs here (vLLM installed), its rollout.<engine>.* settings are its own
        check_engine(cfg.rollout.engine, engine_settings(cfg)).check_explorer(build_explorer(cfg.explorer))
    except ValueError as err:
        raise named_error(err, "rollout") from err
    try:
        parse_dtype(cfg.model.dtype)
    except ValueError as err:
        raise named_error(err, "model.dtype") from err
    check_model_settings(cfg)


def check_run_settings(cfg: DictConfig) -> None:
    """Types and ranges of ``seed``, ``rollout.*``, ``data.*`` counts, ``trainer.max_steps``; errors name the key."""
    r, d = cfg.rollout, cfg.data
    estimator = resolve_advantage(cfg.advantage)
    checks = [
        ("rollout.group_size", r.group_size, getattr(estimator, "min_group_size", 2)),
        ("rollout.max_new_tokens", r.max_new_tokens, 1),
        ("rollout.val_samples", r.val_samples, 1),
        ("rollout.val_batch_size", r.val_batch_size, 1),
        ("data.prompts_per_step", d.prompts_per_step, 1),
        ("data.max_prompt_tokens", d.max_prompt_tokens, 1),
    ]
    try:
        for key, value, low in checks:
            check_number(key, value, low, integer=True)
        check_seed(cfg.get("seed", 0))
        check_number("rollout.val_temperature", r.val_temperature, 0.0)
        check_bool("rollout.ignore_eos", r.get("ignore_eos", False))
        check_bool("overwrite", cfg.get("overwrite", False))
        max_steps = cfg.trainer.get("max_steps", -1)
        if max_steps != -1:  # Lightning's "no step limit" (then trainer.max_epochs bounds the run)
            check_number("trainer.max_steps", max_steps, 1, integer=True)
    except ValueError as err:
        if "rollout.group_size" in str(err) and isinstance(r.group_size, int):
            raise ConfigError(
                f"{err}: advantage={cfg.advantage} compares each rollout with the other samples of its "
                "prompt, so a group of 1 has zero advantage and nothing is learned"
            ) from err
        raise ConfigError(str(err)) from err


def build_module(
    cfg: DictConfig,
    backend_choices: dict | None = None,
    explorer: Explorer | None = None,
    objective: PolicyObjective | None = None,
) -> RLModule:
    """The policy (and reference), explorer, objective and reward as an RLModule; ``backend_choices``: a resumed
    run's, reused, not measured anew; ``explorer``, ``objective``: a script's objects, checked alike."""
    check_config(cfg)  # bad values fail here, before minutes of model loading
    explorer = build_explorer(cfg.explorer) if explorer is None else checked_explorer(explorer)
    objective = build_objective(cfg.objective) if objective is None else checked_objective(objective)
    optim, train, _ = settings(cfg)
    backend = build_backend(cfg)
    if backend_choices:
        backend.use_recorded(backend_choices)
    policy, tokenizer = load_policy(
        cfg.model.name_or_path,
        dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code,
        attn_implementation=backend.attention,
    )
    check_context(
        policy,
        ("data.max_prompt_tokens", cfg.data.max_prompt_tokens),
        ("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
    )
    try:  # before the first rollout builds the engine
        check_engine(cfg.rollout.engine, engine_settings(cfg)).check_model(policy)
    except ValueError as err:
        raise ConfigError(f"rollout.engine={cfg.rollout.engine}: {err}") from err
    policy, reference, adapters = prepare_models(cfg, policy, objective.needs_reference, backend)
    eval_explorer = TemperatureExplorer(temperature=cfg.rollout.val_temperature)
    try:
        return RLModule(
            policy,
            tokenizer,
            explorer,
            objective,
            build_reward(cfg.reward),
            reference=reference,
            optim=optim,
            train=train,
            advantage=cfg.advantage,
            eval_explorer=eval_explorer,
            detach_mixture=cfg.detach_mixture,
            parallel=parallel_config(cfg),
            seed=cfg.seed,
            step_hooks=build_step_hooks(cfg),
            adapters=adapters,
            backend=backend,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from err


def build_step_hooks(cfg: DictConfig) -> list[StepHook]:
    """The step hooks the config asks for: a ``ReplayBuffer`` when ``replay.capacity`` > 0."""
    _, _, replay = settings(cfg)
    if not replay.capacity:
        return []
    return [ReplayBuffer(capacity=replay.capacity, max_staleness=replay.max_staleness, is_cap=replay.is_cap)]


def build_pass_at_k(cfg: DictConfig, val_problems) -> list[L.Callback]:
    """``callbacks.PassAtK`` on the run's validation problems when ``pass_at_k.n`` > 0."""
    opts = cfg.get("pass_at_k") or {}
    if not opts.get("n") or not val_problems:
        return []
    d = cfg.data
    name = d.get("name") or d.source
    evalset = EvalSet(
        name,
        list(val_problems),
        instruction=d.instruction,
        system_prompt=d.system_prompt,
        answer_format=d.answer_format,
        max_prompt_tokens=d.max_prompt_tokens,
    )
    try:
        return [
            PassAtK(
                [evalset],
                n=opts.n,
                every_n_steps=opts.every_n_steps,
                temperature=opts.temperature,
                top_p=opts.top_p,
                max_new_tokens=opts.max_new_tokens,
                batch_size=opts.batch_size,
                seed=cfg.seed,
            )
        ]
    except ValueError as err:
        raise named_error(err, "pass_at_k") from err
