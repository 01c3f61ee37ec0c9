"""Log a table of sample rollouts (prompt, response, reward) to MLflow every N steps."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.loggers import MLFlowLogger

from ngrpo_lightning.rollout.context import run_context


class RolloutSamplesLogger(L.Callback):
    """Every ``every_n_steps`` rollout batches (the first included), log ``num_samples`` rollouts as an
    MLflow table ``samples/step_<step>.json``, named by ``trainer.global_step``. Needs the module's
    ``training_step`` to return ``{"rewards": ..., "status": ...}``.
    """

    def __init__(self, every_n_steps: int = 5, num_samples: int = 8, max_chars: int = 2000):
        self.every_n_steps, self.num_samples, self.max_chars = every_n_steps, num_samples, max_chars
        self.batches_seen = 0

    def state_dict(self) -> dict:
        return {"batches_seen": self.batches_seen}

    def load_state_dict(self, state_dict: dict) -> None:
        self.batches_seen = int(state_dict.get("batches_seen", 0))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.batches_seen += 1
        step = trainer.global_step  # already incremented by the optimizer steps of this batch
        logger = trainer.logger
        if not isinstance(logger, MLFlowLogger) or not outputs or (self.batches_seen - 1) % self.every_n_steps:
            return
        if trainer.global_rank != 0:
            return
        rows = list(range(min(self.num_samples, len(batch))))
        prompts = run_context(trainer).tokenizer.batch_decode(batch.prompt_ids[rows].cpu(), skip_special_tokens=True)
        table = {
            "step": [step] * len(rows),
            "problem_id": [batch.problem_ids[i] if batch.problem_ids else "" for i in rows],
            "prompt": [p[-self.max_chars :] for p in prompts],
            "response": [batch.response_text[i][: self.max_chars] for i in rows],
            "gold": [batch.answers[i] if batch.answers else "" for i in rows],
            "reward": [float(outputs["rewards"][i]) for i in rows],
            "status": [outputs["status"][i] for i in rows],
        }
        logger.experiment.log_table(logger.run_id, data=table, artifact_file=f"samples/step_{step:06d}.json")
