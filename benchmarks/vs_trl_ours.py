"""Our side of ``benchmarks/vs_trl.py``: the real ``ngrpo train`` entry point on the workload.

``ours_config(workload)`` is the composed run configuration, ``prompt_batches(workload)`` the
prompt batches its ``RolloutDataModule`` draws (TRL's side trains on the same sequence). The
run adds one callback to the trainer, :class:`StepRecorder`, which reads the metrics the module
logs every step; the fixed-length workload sets ``rollout.ignore_eos=true``. Checkpoints are
saved as ``ngrpo train`` saves them by default (into a temporary folder), unless the workload
says ``saves=false``.

    .venv/bin/python benchmarks/vs_trl_ours.py --workload '{"steps": 2}' --out ours.json
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).parent))
from step_profile import StepProfile  # noqa: E402
from vs_trl_workload import Workload, child_main, peak_rss_now, prompt_counts  # noqa: E402

from ngrpo_lightning.commands import cli  # noqa: E402
from ngrpo_lightning.config import compose  # noqa: E402

# record key -> the metric the module logs (rollout/*: the engine; time/*: RLModule.training_step)
METRICS = {
    "step_s": "time/step_s",
    "gen_s": "rollout/time_s",
    "reward_s": "time/reward_s",
    "logprobs_s": "time/logprobs_s",  # reference log-probs (the old ones reuse the update's forward)
    "update_s": "time/update_s",
    "tokens": "rollout/tokens",
}


def ours_overrides(workload: Workload, output_dir: str) -> list[str]:
    """The ``ngrpo train`` command line of the workload."""
    return [
        f"model.name_or_path='{workload.model_path()}'",
        f"model.dtype={workload.dtype}",
        *(["data=files", f"data.train='{workload.problems}'"] if workload.problems else ["data.val_size=0"]),
        f"data.prompts_per_step={workload.prompts}",
        f"rollout.group_size={workload.group}",
        f"rollout.max_new_tokens={workload.tokens}",
        f"rollout.engine={workload.engine}",
        f"rollout.ignore_eos={str(not workload.natural).lower()}",  # fixed length unless natural
        "explorer=temperature",
        f"explorer.temperature={workload.temperature}",
        "objective=grpo",
        f"objective.kl_coef={workload.kl_coef}",
        "objective.kl_estimator=k3",
        f"optim.lr={workload.lr}",
        f"optim.micro_batch_size={workload.micro_batch}",
        "optim.warmup_steps=0",
        "train.ppo_epochs=1",
        "train.num_mini_batches=1",
        f"trainer.max_steps={workload.steps}",
        *([] if workload.saves else ["trainer.enable_checkpointing=false", "checkpoint.every_n_steps=0"]),
        "trainer.enable_progress_bar=false",
        "logger=none",
        "validate_before_fit=false",
        "pass_at_k.n=0",
        f"output_dir='{output_dir}'",
        f"seed={workload.seed}",
        f"trainer={workload.accelerator}",
        *(
            [
                "model.lora.enabled=true",
                f"model.lora.rank={workload.lora_rank}",
                f"model.lora.alpha={2 * workload.lora_rank}",
                "model.lora.target_modules=all-linear",
            ]
            if workload.lora_rank
            else []
        ),
        *workload.ours_overrides,
    ]


def ours_config(workload: Workload, output_dir: str = "outputs", extra: Sequence[str] = ()):
    """The composed run configuration (a ``DictConfig``), with ``extra`` overrides last."""
    return compose([*ours_overrides(workload, output_dir), *extra])


def prompt_batches(workload: Workload) -> list[dict]:
    """The prompt batches of the workload's ``steps`` steps as the run's ``RolloutDataModule``
    draws them: dicts of lists (``prompt_text``, ``prompt_ids``, ``answer``, ``id``)."""
    from ngrpo_lightning.build.data import build_datamodule, build_problems
    from ngrpo_lightning.models.loading import load_tokenizer

    cfg = ours_config(workload)
    datamodule = build_datamodule(cfg, load_tokenizer(cfg.model.name_or_path), build_problems(cfg.data, cfg.seed))
    datamodule.setup("fit")
    return list(itertools.islice(datamodule.train_dataloader(), workload.steps))


class StepRecorder(L.Callback):
    """Per-step records from the metrics the module logs."""

    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        step = {key: float(metrics[name]) for key, name in METRICS.items()}
        step["tokens"] = round(step["tokens"])
        # seconds this step's rollout spent recording CUDA graphs (logged only where it decodes from them)
        step["graph_record_s"] = float(metrics.get("rollout/graph_warmup_s", 0.0))
        if "rollout/graphs_whole_step" in metrics:  # graphs of whole steps (1) or of the model's step (0)
            step["whole_step_graphs"] = float(metrics["rollout/graphs_whole_step"])
        # the engine's log-probs of the sampled tokens against the training forward's (the records rebuilt)
        step["logprob_diff_max"] = float(metrics.get("train/rollout_logprob_diff_max", float("nan")))
        step.update(
            prompt_counts(batch.prompt_mask.sum(1).tolist(), batch.group_size, batch.response_mask.sum(1).tolist())
        )
        step["rss_bytes"] = peak_rss_now()  # before this step's checkpoint save: Lightning runs saving callbacks last
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # a GPU run (benchmarks/large_shapes.py)
            step["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
            step["cuda_reserved_bytes"] = torch.cuda.max_memory_reserved()
        self.steps.append(step)


def run(workload: Workload, extra: Sequence[str] = (), more_callbacks: Sequence[L.Callback] = ()) -> list[dict]:
    """``ngrpo train`` on the workload (``extra`` overrides last), with a :class:`StepRecorder`
    and ``more_callbacks`` among the trainer's callbacks. With ``workload.profile_step`` that
    step is profiled (:class:`~step_profile.StepProfile`): its record gets ``profile``, the
    report of its phases."""
    recorder = StepRecorder()
    profile = StepProfile(workload.profile_step, workload.profile_trace or None) if workload.profile_step else None
    callbacks = [recorder, *([profile] if profile else []), *more_callbacks]
    with tempfile.TemporaryDirectory(prefix="vs-trl-ours-") as tmp:
        cli.train(ours_config(workload, tmp, extra), callbacks=callbacks)
    if profile is not None and profile.report is not None:
        recorder.steps[workload.profile_step]["profile"] = profile.report
    return recorder.steps


if __name__ == "__main__":
    child_main(run)
