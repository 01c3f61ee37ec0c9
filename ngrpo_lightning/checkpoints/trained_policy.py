"""A run's trained policy from its checkpoint (``ngrpo eval``, ``ngrpo export``): find it (:func:`find_checkpoint`),
read what the run recorded (config, base model, MLflow run), load its weights into the base model."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ngrpo_lightning.backends import attention
from ngrpo_lightning.checkpoints.run import check_base_model, weights_digest
from ngrpo_lightning.checkpoints.safe_load import META_FILE, load_checkpoint
from ngrpo_lightning.compat.transformers import tied_weight_names
from ngrpo_lightning.config import DEFAULT_TRACKING_URI, ConfigError
from ngrpo_lightning.models import lora
from ngrpo_lightning.models.loading import load_policy
from ngrpo_lightning.tracking.logger import existing_store

__all__ = ["TrainedCheckpoint", "find_checkpoint", "is_run_checkpoint", "load_trained_policy", "read_checkpoint"]


@dataclass
class TrainedCheckpoint:
    """What a checkpoint says about its run (the weights stay on disk until loaded)."""

    path: Path
    meta: dict = field(default_factory=dict)  # the module's ``ngrpo`` entry: config, MLflow run id, base model
    global_step: int | None = None
    state_dict: dict | None = None  # a single-file checkpoint's weights (memory-mapped); None: distributed
    hyper_parameters: dict = field(default_factory=dict)  # checkpoints of other scripts may name their model here

    @property
    def config(self) -> dict:
        return self.meta.get("config") or {}

    @property
    def base_model(self) -> str | None:
        """The model the run started from: its config's ``model.name_or_path``."""
        found = (self.config.get("model") or {}).get("name_or_path")
        if not found:  # checkpoints written by other scripts: model.name_or_path in their hyper-parameters
            found = _find_name(self.hyper_parameters)
        return str(found) if found else None

    @property
    def distributed(self) -> bool:
        return self.path.is_dir()


def is_run_checkpoint(source: str) -> bool:
    """Whether ``source`` is a checkpoint or a run's ``output_dir`` (rather than a model)."""
    path = Path(source).expanduser()
    if path.suffix == ".ckpt" or (path / META_FILE).is_file():
        return True
    return path.is_dir() and any(
        (folder / name).exists() for folder in (path / "checkpoints", path) for name in ("last.ckpt", "best.ckpt")
    )


def find_checkpoint(source: str, which: str = "last", tracking_uri: str | None = None) -> Path:
    """The checkpoint ``source`` names: a ``.ckpt`` file or distributed folder; a run's ``output_dir``
    or ``checkpoints/`` (``which``: ``last`` or ``best``); or an MLflow run id, whose ``output_dir`` is
    searched (``tracking_uri``: the store, default the default one where it exists)."""
    path = Path(source).expanduser()
    if path.is_file() or (path / META_FILE).is_file():
        return path
    for folder in (path / "checkpoints", path):
        if (folder / f"{which}.ckpt").exists():
            return folder / f"{which}.ckpt"
    if path.exists():
        raise ConfigError(f"{source}: no {which}.ckpt there or in {path / 'checkpoints'} (is it a run's output_dir?)")
    tracking_uri = tracking_uri or existing_store(DEFAULT_TRACKING_URI)  # where runs log by default, if here
    if tracking_uri:
        output_dir = _mlflow_output_dir(source, tracking_uri)
        if output_dir is not None:
            return find_checkpoint(output_dir, which)
    where = f"the id of a run in {tracking_uri}" if tracking_uri else "an MLflow run id (no store here)"
    raise ConfigError(
        f"{source!r} is not a checkpoint, a run's output_dir or {where}: a run logged elsewhere is "
        "found with --tracking-uri <its logger.tracking_uri>"
    )


def _mlflow_output_dir(run_id: str, tracking_uri: str) -> str | None:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        run = MlflowClient(tracking_uri).get_run(run_id)
    except MlflowException:
        return None
    return run.data.params.get("output_dir")


def read_checkpoint(path: Path) -> TrainedCheckpoint:
    """What ``path`` holds about its run, its weights memory-mapped (file) or left on disk (folder)."""
    path = Path(path)
    ckpt = load_checkpoint(path)  # as data: a file holding anything else is refused, unrun
    return TrainedCheckpoint(
        path=path,
        meta=ckpt.get("ngrpo") or {},
        global_step=ckpt.get("global_step"),
        state_dict=None if path.is_dir() else ckpt.get("state_dict", {}),
        hyper_parameters=_plain(next((ckpt[k] for k in ("hyper_parameters", "config", "cfg") if ckpt.get(k)), {})),
    )


def _plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def load_trained_policy(
    ckpt: TrainedCheckpoint, base: str | None = None, dtype: str | None = None, action: str = "load", **load_kwargs
):
    """``(policy, tokenizer)``: the base model (``base``, or the run's) with the checkpoint's weights, in ``dtype``
    (default: the run's). Base weights from outside the checkpoint (LoRA) must hash to what the run recorded
    (:func:`~ngrpo_lightning.checkpoints.run.check_base_model`; ``action`` names the refused use)."""
    base = base or ckpt.base_model
    if not base:
        raise ConfigError(
            f"checkpoint {ckpt.path} does not name its base model: pass model.name_or_path=<base model> "
            f"checkpoint={ckpt.path}"
        )
    model_cfg = ckpt.config.get("model") or {}
    dtype = dtype or model_cfg.get("dtype") or _saved_dtype(ckpt.state_dict) or "float32"
    load_kwargs.setdefault("trust_remote_code", bool(model_cfg.get("trust_remote_code", False)))
    load_kwargs.setdefault("attn_implementation", attention.NAME)
    policy, tokenizer = load_policy(base, dtype=dtype, **load_kwargs)
    adapters = lora.LoraSettings.from_config(model_cfg.get("lora"))
    if adapters.enabled:  # a LoRA run's checkpoint holds the adapters only: put them on the base model
        policy = lora.apply(policy, adapters)
        saved = ckpt.meta.get("base_model") or {}
        if saved.get("weights_sha256") and dtype == model_cfg.get("dtype", dtype):  # hashes compare in one dtype
            digest = weights_digest(policy, keep=lambda name: not lora.is_adapter_weight(name))
            check_base_model(saved, {"name_or_path": base, "weights_sha256": digest}, action)
    weights = _distributed_policy_weights(ckpt.path, policy) if ckpt.distributed else _policy_weights(ckpt)
    missing, unexpected = policy.load_state_dict(weights, strict=False)
    tied = tied_weight_names(policy)
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if adapters.enabled:  # the base weights come from the base model, not the checkpoint
        missing = [k for k in missing if lora.is_adapter_weight(k)]
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint {ckpt.path} does not match model {base!r}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return policy, tokenizer


def _policy_weights(ckpt: TrainedCheckpoint) -> dict[str, torch.Tensor]:
    weights = {k.removeprefix("policy."): v for k, v in (ckpt.state_dict or {}).items() if k.startswith("policy.")}
    if not weights:
        raise ConfigError(f"checkpoint {ckpt.path} has no policy.* weights in its state_dict")
    return weights


def _distributed_policy_weights(path: Path, policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An FSDP2 checkpoint's policy weights (not the optimizer's), read here into tensors shaped as the base's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    state = {"state_dict": {f"policy.{k}": torch.empty_like(v) for k, v in policy.state_dict().items()}}
    # tied weights may be stored once: what is absent is reported by load_state_dict's check
    # no_dist: read by this process alone, also where a run's process group is still up
    with warnings.catch_warnings():  # that it reads in one process without a process group: as asked
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    return {k.removeprefix("policy."): v for k, v in state["state_dict"].items()}


def _saved_dtype(state_dict: dict | None) -> str | None:
    for v in (state_dict or {}).values():
        if torch.is_tensor(v) and v.is_floating_point():
            return str(v.dtype).removeprefix("torch.")
    return None


def _find_name(node, depth: int = 0):
    """``model.name_or_path`` (or a top-level ``name_or_path``) anywhere in nested hyper-parameters."""
    if not isinstance(node, dict) or depth > 4:
        return None
    model = node.get("model")
    if isinstance(model, dict) and model.get("name_or_path"):
        return model["name_or_path"]
    if node.get("name_or_path"):
        return node["name_or_path"]
    return next((found for v in node.values() if (found := _find_name(v, depth + 1))), None)
