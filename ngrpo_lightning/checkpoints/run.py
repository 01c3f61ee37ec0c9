"""Checkpoints of a run: where they go and when (``checkpoint.*``), resuming (``resume=``), and
what a checkpoint holds beyond Lightning's own state: RNG states and the run's config check."""

from __future__ import annotations

import hashlib
import random
import re
import shutil
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from ngrpo_lightning.checkpoints.best import BestCheckpoint
from ngrpo_lightning.checkpoints.disk import DiskSpaceCheck
from ngrpo_lightning.checkpoints.safe_load import load_checkpoint
from ngrpo_lightning.checks import check_choice, check_number
from ngrpo_lightning.compat import lightning as lightning_compat
from ngrpo_lightning.config import ConfigError


def weights_digest(model: torch.nn.Module, keep=None) -> str:
    """SHA-256 of a model's state dict (names, dtypes, shapes, bytes; only names ``keep`` accepts):
    what a checkpoint records of the frozen reference instead of its weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if keep is not None and not keep(name):
            continue
        data = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{data.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(data.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def check_base_model(saved: dict, current: dict, action: str = "resume") -> None:
    """Refuse a checkpoint on another base model than it started from: the base weights (not stored in
    checkpoints) must hash to what it recorded. ``action`` names what is refused (resume, eval, export)."""
    if not saved or not current or saved.get("weights_sha256") == current.get("weights_sha256"):
        return
    describe = lambda m: f"{m.get('name_or_path')!r} (weights sha256 {str(m.get('weights_sha256'))[:16]}...)"  # noqa: E731
    raise ConfigError(
        f"cannot {action}: the checkpoint's reference is the base model {describe(saved)}, but the base "
        f"model loaded now is {describe(current)}; its weights changed since the run started. Use the original "
        "base model (model.name_or_path)"
    )


def rng_states() -> dict:
    """Python, NumPy, torch (and CUDA) RNG states of this process."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {
        "name": name,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }  # tensors and scalars: loadable with weights_only
    states = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    if "python" in states:
        random.setstate(states["python"])
    if "numpy" in states:
        n = states["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "torch" in states:
        torch.set_rng_state(states["torch"].cpu())
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# config keys that may change between a run and its resumption
RESUMABLE_KEYS = (
    "resume",
    "output_dir",
    "logger",
    "validate_before_fit",
    "checkpoint",
    "export",  # what happens after training, not what it computes
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.enable_progress_bar",
    "trainer.val_check_interval",
    "trainer.log_every_n_steps",
    "reward.num_workers",
    "reward.timeout_s",
    "experiment_name",
    "overwrite",
    "backend",  # how the models compute on this device: same values (bit for bit or to float rounding)
    # retired keys: older checkpoints still resume
    "host",
    "model.attn_implementation",
    "model.recompute_elementwise",
    "model.recompute_up_proj",
    "model.reference_weights",
    "optim.logprob_chunk_size",
    "optim.logprob_keep_softmax_mib",
    "optim.share_prompts",
    "optim.packed_weights",
    "rollout.hf",
    "rollout.ahead_threads",
)


def config_mismatch(saved: dict, current: dict, prefix: str = "") -> str | None:
    """The first difference between two resolved configs that forbids resuming (``None`` if none)."""
    for key in sorted(set(saved) | set(current)):
        name = f"{prefix}{key}"
        if name in RESUMABLE_KEYS:
            continue
        a, b = saved.get(key, "<unset>"), current.get(key, "<unset>")
        if isinstance(a, dict) and isinstance(b, dict):
            inner = config_mismatch(a, b, name + ".")
            if inner:
                return inner
        elif a != b:
            return f"{name} differs: the checkpoint has {a!r}, this run has {b!r}"
    return None


# ---------------------------------------------------------------- run checkpoints
def checkpoint_dir(cfg: DictConfig) -> Path:
    return Path(cfg.output_dir) / "checkpoints"


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` saving the final step too (as a kept step, which ``last`` links to, or as ``last``)."""

    @property
    def state_key(self) -> str:
        """One key whatever ``checkpoint.every_n_steps`` and ``keep`` are (Lightning's key holds the
        settings), so a run resumed with other values restores the files it kept."""
        return lightning_compat.state_key(self, dirpath=self.dirpath, filename=self.filename)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        # Lightning logs a step's metrics after on_train_batch_end, so a process killed right after
        # this checkpoint would lose them: send them first and drop the loop's own send
        every = lightning_compat.every_n_train_steps(self)
        if (
            every
            and trainer.global_step % every == 0
            and not lightning_compat.skips_saving(self, trainer)
            and trainer.loggers
        ):
            step = lightning_compat.batches_that_stepped(trainer)
            lightning_compat.send_train_step_metrics(trainer)
            for logger in trainer.loggers:
                _drop_next_log_of_step(logger, step)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_final(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """On SIGTERM (``SIGTERMException``, raised at the step's end) save that step if no checkpoint holds it."""
        if isinstance(exception, SIGTERMException):
            self._save_final(trainer)

    def _save_final(self, trainer: L.Trainer) -> None:
        """The run's last finished step, when no checkpoint holds it yet."""
        saved = lightning_compat.last_global_step_saved(self)
        if self.save_last and saved != trainer.global_step and not trainer.sanity_checking:
            candidates = lightning_compat.monitor_candidates(self, trainer)
            if self.save_top_k != 0:
                lightning_compat.save_topk(self, trainer, candidates)  # last links to it
            lightning_compat.save_last(self, trainer, candidates)


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
    """Checkpoints in ``<output_dir>/checkpoints``: ``step-<n>.ckpt`` every ``checkpoint.every_n_steps``
    (``checkpoint.keep`` kept), ``last.ckpt`` (also at the end; ``resume=last``), ``best.ckpt`` with
    ``checkpoint.best`` (:class:`BestCheckpoint`), and a disk-space warning (:class:`DiskSpaceCheck`)."""
    if not cfg.trainer.get("enable_checkpointing", True):
        return []
    node = cfg.get("checkpoint") or {}
    try:
        every = check_number("checkpoint.every_n_steps", node.get("every_n_steps", 0) or 0, 0, integer=True)
        keep = check_number("checkpoint.keep", node.get("keep", -1), -1, integer=True)
        mode = check_choice("checkpoint.best_mode", node.get("best_mode", "max"), ("max", "min"))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    best = []
    if node.get("best"):  # the best validation checkpoint, as the N-GRPO release keeps by AIME24 mean@32
        best = [
            BestCheckpoint(
                dirpath=str(checkpoint_dir(cfg)),
                filename="best",
                monitor=re.sub(r"_at_(\d+)$", r"@\1", str(node.best)),  # MLflow's pass_at_16 is Lightning's pass@16
                mode=mode,
                save_top_k=1,
                auto_insert_metric_name=False,
                enable_version_counter=False,
            )
        ]
    # last.ckpt links to the newest step checkpoint when there is one (no second copy on disk)
    callbacks = best + [
        RunCheckpoint(
            dirpath=str(checkpoint_dir(cfg)),
            filename="step-{step}",  # step-15.ckpt (older step-step=15.ckpt still read)
            auto_insert_metric_name=False,
            save_last="link",
            save_top_k=keep if every else 0,
            # Lightning keeps k > 1 checkpoints by a metric only: the newest k are the highest steps
            **({"monitor": "step", "mode": "max"} if every and keep > 1 else {}),
            every_n_train_steps=every or None,
            save_on_train_epoch_end=False,
            enable_version_counter=False,
        )
    ]
    if "://" not in str(cfg.output_dir):  # a remote store's space is not a disk's
        callbacks.append(DiskSpaceCheck(checkpoint_dir(cfg), every, keep, best=bool(best)))
    return callbacks


def resolve_resume(cfg: DictConfig) -> str | None:
    """The checkpoint ``resume`` names: ``null`` (none), ``last`` (``<output_dir>/checkpoints/last.ckpt``)
    or a path (a ``.ckpt`` file, or the folder of a distributed checkpoint)."""
    resume = cfg.get("resume")
    if resume in (None, "", False):
        return None
    path = checkpoint_dir(cfg) / "last.ckpt" if str(resume) == "last" else Path(str(resume))
    if not path.exists():
        where = (
            f" (resume=last reads {path}: checkpoints of output_dir={cfg.output_dir})" if str(resume) == "last" else ""
        )
        raise ConfigError(f"resume={resume}: no checkpoint at {path}{where}")
    return str(path)


def checkpoint_meta(path: str) -> dict:
    """What the module stored about the run in a checkpoint (``ngrpo``: config, MLflow run id), without a model."""
    try:
        ckpt = load_checkpoint(path)
    except ConfigError as err:  # unreadable, or holding more than data: nothing of it ran
        raise type(err)(f"resume: {err}") from None
    return ckpt.get("ngrpo") or {}


def check_resume(cfg: DictConfig, meta: dict) -> None:
    """A checkpoint of a different model or config cannot be resumed: the error names the key."""
    saved = meta.get("config")
    if saved is None:
        return
    problem = config_mismatch(saved, OmegaConf.to_container(cfg, resolve=True))
    if problem:
        raise ConfigError(f"resume={cfg.resume}: the checkpoint is of a different run: {problem}")


# ---------------------------------------------------------------- one run per output_dir
def _run_in(folder: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint in a checkpoints folder and what it says about its run."""
    found = sorted((p for p in folder.iterdir() if p.suffix == ".ckpt"), key=lambda p: p.stat().st_mtime)
    if not found:
        return None
    newest = folder / "last.ckpt" if (folder / "last.ckpt").exists() else found[-1]
    try:
        ckpt = load_checkpoint(newest)  # a distributed checkpoint keeps its meta in its folder
        meta = dict(ckpt.get("ngrpo") or {}, global_step=ckpt.get("global_step"))
    except ConfigError:  # an unreadable (or unsafe) file still belongs to some earlier run
        meta = {}
    return newest, meta


def _describe(path: Path, meta: dict) -> str:
    config = meta.get("config") or {}
    parts = [f"{path}"]
    if meta.get("global_step") is not None:
        parts.append(f"step {meta['global_step']}")
    if config.get("experiment_name"):
        parts.append(f"experiment {config['experiment_name']}")
    if meta.get("mlflow_run_id"):
        parts.append(f"MLflow run {meta['mlflow_run_id']}")
    parts.append("saved " + time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime)))
    return ", ".join(parts)


def claim_output_dir(cfg: DictConfig, ckpt_path: str | None, meta: dict) -> None:
    """One run per ``output_dir``: a new run into a folder holding another run's checkpoints is refused, naming the
    run found and the ways out; ``overwrite=true`` deletes them first; a resumed run may write where its run wrote."""
    folder = checkpoint_dir(cfg)
    if rank_zero_only.rank != 0 or not folder.is_dir():  # the other ranks start after rank 0 checked
        return
    found = _run_in(folder)
    if found is None:
        return
    path, other = found
    if ckpt_path is not None:
        inside = folder.resolve() in Path(ckpt_path).resolve().parents
        if inside or other.get("mlflow_run_id") == meta.get("mlflow_run_id"):
            return
    if cfg.get("overwrite"):
        shutil.rmtree(folder)
        print(f"ngrpo: overwrite=true: deleted the checkpoints of the earlier run in {folder}")
        return
    raise ConfigError(
        f"output_dir={cfg.output_dir} holds another run's checkpoints ({_describe(path, other)}); "
        "a new run there would replace them. Continue that run with resume=last, write this one "
        "elsewhere with output_dir=<another folder>, or replace them with overwrite=true"
    )
