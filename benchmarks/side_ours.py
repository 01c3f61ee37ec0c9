"""This project's side: the ``ngrpo train`` job of a workload (``workloads.train_overrides``),
through the command's own ``train``, with :class:`StepRecorder` among the trainer's callbacks: it
reads the metrics the module logs every step. A side's process (``sides.py``); with
``--profile-step`` that step is profiled (``step_profile.py``), with ``--memory`` each phase's peak
RSS is read (``memory_phases.py``).

    .venv/bin/python benchmarks/side_ours.py --workload '{"steps": 2}' --out ours.json
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile

import lightning as L
import torch
from sides import child_main, peak_rss_now, prompt_counts
from workloads import Workload, train_overrides

# record key -> the metric the module logs (rollout/*: the engine; time/*: RLModule.training_step)
METRICS = {
    "step_s": "time/step_s",
    "gen_s": "rollout/time_s",
    "reward_s": "time/reward_s",
    "logprobs_s": "time/logprobs_s",  # reference log-probs (the old ones reuse the update's forward)
    "update_s": "time/update_s",
    "tokens": "rollout/tokens",
}


def ours_config(workload: Workload, output_dir: str = "outputs"):
    """The composed run configuration (a ``DictConfig``)."""
    from ngrpo_lightning.config import compose

    return compose(train_overrides(workload, output_dir))


def prompt_batches(workload: Workload) -> list[dict]:
    """The prompt batches of the workload's steps as the run's ``RolloutDataModule`` draws them:
    dicts of lists (``prompt_text``, ``prompt_ids``, ``answer``, ``id``)."""
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
        # the engine's log-probs of the sampled tokens against the training forward's
        step["logprob_diff_max"] = float(metrics.get("train/rollout_logprob_diff_max", float("nan")))
        lengths = lambda mask: mask.sum(1).tolist()
        step |= prompt_counts(lengths(batch.prompt_mask), batch.group_size, lengths(batch.response_mask))
        step["rss_bytes"] = peak_rss_now()  # before this step's checkpoint save: saving callbacks run last
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            step["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
            step["cuda_reserved_bytes"] = torch.cuda.max_memory_reserved()
        self.steps.append(step)


def run(workload: Workload, options) -> dict:
    """The workload's ``ngrpo train``; its per-step records, the profiled step's phase report
    (``profile``) and each phase's peak RSS (``memory``) where ``options`` ask for them."""
    from memory_phases import Milestones, PhaseMeter
    from step_profile import StepProfile

    from ngrpo_lightning.commands.train import train

    recorder, milestones = StepRecorder(), Milestones()
    profile = StepProfile(options.profile_step, options.trace or None) if options.profile_step else None
    meter = PhaseMeter(trim=options.memory == "trim") if options.memory else None
    callbacks = [recorder, *([profile] if profile else []), *([milestones] if meter else [])]
    metering = meter.around_training() if meter else contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="ours-") as tmp, metering:
        train(ours_config(workload, tmp), callbacks=callbacks)
    result = {"steps": recorder.steps}
    if profile is not None and profile.report is not None:
        result["profile"] = {"step": options.profile_step, "phases": profile.report}
    if meter is not None:
        meter.fold()
        result["memory"] = {"points": milestones.points, "after_step": milestones.after_step,
                            "tensors": milestones.tensors, "phase_peaks": meter.peaks,
                            "peak": meter.process_peak}  # fmt: skip
    return result


if __name__ == "__main__":
    child_main(run)
