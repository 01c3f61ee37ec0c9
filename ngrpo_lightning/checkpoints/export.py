"""``ngrpo export``: a trained policy as a Hugging Face model directory.

    ngrpo export <checkpoint | run output_dir | MLflow run id> <out_dir> [--which best]

The directory holds what transformers, vLLM and the Hub read, and a model card (``README.md``)
saying where the policy came from. ``export.final=true`` exports at the end of ``ngrpo train`` into
the run's MLflow artifacts (``model/``). A LoRA run exports peft adapters; ``--merge`` merges them in."""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path

import torch

from ngrpo_lightning.checkpoints.disk import disk_full
from ngrpo_lightning.checkpoints.trained_policy import (
    TrainedCheckpoint,
    find_checkpoint,
    load_trained_policy,
    read_checkpoint,
)
from ngrpo_lightning.config import ConfigError
from ngrpo_lightning.models.lora import has_adapters

__all__ = ["export_checkpoint", "model_card", "save_hf_model"]

VAL_METRICS = ("val/accuracy", "val/reward")


# The files a Hugging Face model or a peft adapter is read from: a folder must hold one kind only
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
MODEL_GLOBS = ("model-*-of-*.safetensors", "pytorch_model-*-of-*.bin")


def check_target(out_dir: Path, overwrite: bool) -> list[Path]:
    """Refuse a non-empty ``out_dir`` unless ``overwrite``; then return its model files to replace (others stay)."""
    held = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
        raise ConfigError(
            f"export: {out_dir} is not empty (it holds {shown}): name a new folder, or pass --overwrite "
            "to replace the model there (other files are kept; README.md becomes the model card)"
        )
    paths = [out_dir / name for name in held]
    return [p for p in paths if p.is_file() and (p.name in MODEL_FILES or any(p.match(g) for g in MODEL_GLOBS))]


def is_own_export(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a model this project exported (its model card says so)."""
    card = out_dir / "README.md"
    return card.is_file() and "- ngrpo-lightning\n" in card.read_text(errors="replace")


def save_hf_model(
    policy: torch.nn.Module, tokenizer, out_dir: Path, card: str, overwrite: bool = False, written: list | None = None
) -> Path:
    """``policy`` and ``tokenizer`` in Hugging Face's format, with ``card`` as README.md (a non-empty
    ``out_dir`` only with ``overwrite``). Written beside ``out_dir`` and moved in when complete, so a
    failed export leaves it as it was. ``written`` receives the names of the files written."""
    out_dir = Path(out_dir)
    replaced = check_target(out_dir, overwrite)
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)  # from an export that was killed
    try:
        staging.mkdir(parents=True)
        policy.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / "README.md").write_text(card)
    except Exception as err:
        written = sum(f.stat().st_size for f in staging.iterdir()) if staging.is_dir() else 0
        full = disk_full(err, out_dir, written, "model export", AGAIN)
        shutil.rmtree(staging, ignore_errors=True)
        if full is not None:
            raise full from err
        raise
    # transformers writes the weights with mode 0600: give them the mode of the folder's other files
    mode = (staging / "README.md").stat().st_mode & 0o777
    for weights in staging.glob("*.safetensors"):
        weights.chmod(mode)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in replaced:
        path.unlink(missing_ok=True)
    for path in staging.iterdir():
        os.replace(path, out_dir / path.name)
        if written is not None:
            written.append(path.name)
    staging.rmdir()
    return out_dir


AGAIN = (
    "The folder is as it was: free space, then export again (ngrpo export <the run's output_dir> <folder> "
    "writes it from the run's last checkpoint)"
)


def export_checkpoint(
    source: str,
    out_dir: str | Path,
    *,
    which: str = "last",
    tracking_uri: str | None = None,
    dtype: str | None = None,
    log_to_mlflow: bool = True,
    merge: bool = False,
    overwrite: bool = False,
) -> dict:
    """Export ``source``'s policy (:func:`~ngrpo_lightning.checkpoints.trained_policy.find_checkpoint`) to ``out_dir``
    (non-empty: only with ``overwrite``); with ``log_to_mlflow`` and a reachable store, also to the run's artifacts."""
    check_target(Path(out_dir), overwrite)  # before minutes of loading
    path = find_checkpoint(source, which, tracking_uri)
    ckpt = read_checkpoint(path)
    uri = tracking_uri or _run_tracking_uri(ckpt)
    policy, tokenizer = load_trained_policy(ckpt, dtype=dtype, action="export")
    adapters = has_adapters(policy)
    if adapters and merge:  # base + (alpha / rank) B A in every adapted layer: a plain model
        policy, adapters = policy.merge_and_unload(), False
    metrics = _mlflow_metrics(ckpt.meta.get("mlflow_run_id"), uri)
    card = model_card(ckpt.config, ckpt.meta, ckpt.global_step, metrics, adapters=adapters)
    written: list[str] = []
    out = save_hf_model(policy, tokenizer, Path(out_dir), card, overwrite=overwrite, written=written)
    logged = log_to_mlflow and _log_artifacts(ckpt.meta.get("mlflow_run_id"), uri, out, written)
    lines = [
        f"Exported {path} (step {ckpt.global_step}) to {out}"
        + (" (LoRA adapters in peft's format; --merge writes a full model)" if adapters else ""),
        f"  load it: AutoModelForCausalLM.from_pretrained({str(out)!r})"
        + (" (with peft installed: its base model with the adapters)" if adapters else ""),
        f"  evaluate it: ngrpo eval model={out}",
    ]
    if logged:
        lines.append(f"  logged to MLflow run {ckpt.meta['mlflow_run_id']} as artifacts model/")
    return {"out": out, "checkpoint": path, "logged": bool(logged), "text": "\n".join(lines)}


def model_card(config: dict, meta: dict, steps: int | None, metrics: dict[str, float], adapters: bool = False) -> str:
    """README.md of an exported policy in the Hub's model-card format (``adapters``: LoRA adapters)."""
    model, data = config.get("model") or {}, config.get("data") or {}
    explorer, objective = config.get("explorer") or {}, config.get("objective") or {}
    base = model.get("name_or_path", "unknown")
    task = data.get("name") or data.get("source", "unknown")
    if data.get("tasks"):
        task += f" ({', '.join(map(str, data['tasks']))})"
    describe = lambda node: ", ".join(f"{k}={v}" for k, v in node.items() if k != "name")  # noqa: E731
    shown = {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}
    rows = [
        ("base model", f"`{base}`"),
        ("task", task),
        ("data seed", str(config.get("seed", "unknown"))),
        ("explorer", f"`{explorer.get('name') or explorer.get('_target_', '?')}` ({describe(explorer)})"),
        ("objective", f"`{objective.get('name') or objective.get('_target_', '?')}` ({describe(objective)})"),
        ("advantage", f"`{config.get('advantage', '?')}`"),
        ("optimizer steps", str(steps)),
        ("MLflow run", f"`{meta.get('mlflow_run_id')}`" if meta.get("mlflow_run_id") else "none (logging off)"),
    ]
    rows += [(f"final {k}", f"{v:.4f}") for k, v in shown.items()]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    command = meta.get("command") or "unknown (written before commands were recorded)"
    hub_id = "/" in base and not Path(base).expanduser().exists()  # the Hub's field names a Hub model only
    base_tag = f"base_model: {base}\n" if hub_id else ""
    return (
        f"---\n{base_tag}library_name: transformers\ntags:\n- ngrpo-lightning\n- reinforcement-learning\n"
        f"- {objective.get('name', 'rl')}\n{_seed_line(config)}---\n\n"
        f"# {config.get('experiment_name', 'policy')}: {base} trained with ngrpo-lightning\n\n"
        f"| | |\n| --- | --- |\n{table}\n\n"
        f"Trained with:\n\n```\n{command}\n```\n\n"
        + (
            "LoRA adapters in peft's format. Load them with `transformers.AutoModelForCausalLM.from_pretrained("
            "<this folder>)` (with peft installed: the base model with the adapters); evaluate them with "
            "`ngrpo eval model=<this folder>` (merged into the base); `ngrpo export <run> <folder> --merge` "
            "writes a whole model, which `vllm serve` takes.\n"
            if adapters
            else "Load it with `transformers.AutoModelForCausalLM.from_pretrained(<this folder>)`; serve it with "
            "`vllm serve <this folder>`; evaluate it with `ngrpo eval model=<this folder>`.\n"
        )
    )


SEED_KEY = "ngrpo_data_seed"  # the card's front-matter key of the run's data seed (ngrpo eval reads it)


def _seed_line(config: dict) -> str:
    return f"{SEED_KEY}: {int(config['seed'])}\n" if isinstance(config.get("seed"), int) else ""


def exported_data_seed(folder: str | Path) -> int | None:
    """The data seed of the run an exported folder came from (its card's front matter), or None."""
    card = Path(folder).expanduser() / "README.md"
    if not card.is_file():
        return None
    found = re.search(rf"^{SEED_KEY}: (\d+)$", card.read_text(errors="replace").split("\n---", 1)[0], re.M)
    return int(found[1]) if found else None


def _run_tracking_uri(ckpt: TrainedCheckpoint) -> str | None:
    logger = ckpt.config.get("logger") or {}
    return logger.get("tracking_uri")


def _mlflow_metrics(run_id: str | None, uri: str | None) -> dict[str, float]:
    """The run's last validation metrics, when its store is reachable (else none)."""
    if not run_id or not uri:
        return {}
    try:
        from mlflow import MlflowClient  # a run that logged to MLflow has it

        client = MlflowClient(uri)
        out = {}
        for key in VAL_METRICS:
            history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
            if history:
                out[key] = history[-1].value
        return out
    except Exception:  # noqa: BLE001 - the card is written without them
        return {}


def log_exported(client, run_id: str, out: Path, written: list[str]) -> None:
    """The files an export wrote (``written``) as the run's ``model/`` artifacts; no other file."""
    for name in sorted(written):
        client.log_artifact(run_id, str(out / name), "model")


def _log_artifacts(run_id: str | None, uri: str | None, out: Path, written: list[str]) -> bool:
    if not run_id or not uri:
        return False
    try:
        from mlflow import MlflowClient

        log_exported(MlflowClient(uri), run_id, out, written)
        return True
    except Exception:  # noqa: BLE001 - the export itself is done; the summary says it was not logged
        return False
