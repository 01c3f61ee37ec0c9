"""TRL's side (``harness.py vs_trl``): ``trl.GRPOTrainer`` (TRL 1.16) on the side-by-side workload.

``trl_config(workload)`` is the ``GRPOConfig``, ``trl_dataset(workload)`` the prompt texts of
our side's ``RolloutDataModule`` in its order (read unshuffled), and ``build_trainer`` the
trainer: the workload's model directory (loaded by TRL itself), ngrpo's tokenizer for that
directory, and ngrpo's ``MathReward`` as the reward function.

Timed phases, per optimizer step (a ``GRPOTrainer`` subclass and a ``TrainerCallback``):

* ``gen_s``: ``_generate`` (prompt tokenization, ``model.generate`` or vLLM, decoding);
* ``reward_s``: ``_calculate_rewards``;
* ``logprobs_s``: ``_get_per_token_logps_and_entropies`` without gradients (reference; old
  log-probs too when TRL computes them);
* ``update_s``: from the end of each ``_prepare_inputs`` (generation and scoring in the first
  of a step) to the next one or the end of the optimizer step: the loss forwards and backwards
  of every micro-batch (``--micro-batch``), gradient clipping, ``optimizer.step``;
* ``step_s``: between consecutive ``on_step_end`` callbacks (the first from ``on_train_begin``).

    .venv/bin/python benchmarks/side_trl.py --workload '{"steps": 2}' --out trl.json
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import torch
from side_ours import ours_config, prompt_batches
from sides import PHASES, child_main, peak_rss_now, prompt_counts
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from workloads import Workload


def trl_config(workload: Workload, output_dir: str = "outputs") -> GRPOConfig:
    """The workload as a ``GRPOConfig``: one optimizer step per generation of prompts x group completions."""
    batch = workload.prompts * workload.group
    micro = workload.micro_batch or batch  # rows per forward/backward; generation still makes the whole batch at once
    if batch % micro:
        raise ValueError(f"micro_batch={micro} must divide the batch of {batch} rows on TRL's side")
    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=workload.accelerator == "cpu",
        seed=workload.seed,
        # the model: its dtype's weights, no autocast; activation checkpointing (TRL's default) only
        # where the workload asks for it (the trl-ac side)
        model_init_kwargs={"dtype": workload.dtype},
        bf16=False,
        fp16=False,
        gradient_checkpointing=workload.activation_checkpointing,
        # a step: prompts x group completions, generated once, one optimizer update
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro,
        num_generations=workload.group,
        num_iterations=1,
        max_steps=workload.steps,
        shuffle_dataset=False,  # step k trains on our side's k-th prompt batch
        remove_unused_columns=False,  # the reward reads the `answer` column
        # generation
        max_completion_length=workload.tokens,
        generation_kwargs=None if workload.natural else {"min_new_tokens": workload.tokens},
        temperature=workload.temperature,
        top_p=1.0,
        top_k=0,
        use_vllm=workload.engine == "vllm",
        vllm_mode="colocate",
        vllm_max_model_length=4096 + workload.tokens,  # ours: data.max_prompt_tokens + rollout.max_new_tokens
        vllm_enable_sleep_mode=False,
        vllm_importance_sampling_correction=False,  # ours has none by default: no extra old log-prob pass
        # the objective: GRPO, token-mean loss, KL to a frozen reference (TRL's KL is the k3 estimator)
        beta=workload.kl_coef,
        epsilon=0.2,
        epsilon_high=0.2,
        loss_type="dapo",  # token-mean over the step's batch
        scale_rewards="group",
        # the optimizer: AdamW at a constant learning rate, gradients clipped at norm 1
        learning_rate=workload.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",  # both sides: fused AdamW (TRL's default with torch >= 2.8)
        # no evaluation or reporting; checkpoints as TRL's defaults save them (unless saves=False)
        eval_strategy="no",
        **({} if workload.saves else {"save_strategy": "no"}),
        report_to="none",
        logging_steps=1,
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def trl_dataset(workload: Workload):
    """Our side's prompt texts (chat template applied) and gold answers, in its order."""
    from datasets import Dataset

    rows = [
        {"prompt": text, "answer": answer}
        for batch in prompt_batches(workload)
        for text, answer in zip(batch["prompt_text"], batch["answer"])
    ]
    return Dataset.from_list(rows)


def math_reward(reward):
    """ngrpo's ``MathReward`` as a TRL reward function (1.0 for a correct answer, else 0.0)."""

    def correct(completions, answer, **kwargs) -> list[float]:
        return reward(list(completions), list(answer)).scores.tolist()

    return correct


def sync() -> None:
    """Wait for the GPU, if one is at work, so that a phase's time is its own (a no-op on a CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PhaseClock(TrainerCallback):
    """Per-optimizer-step records: the phases :class:`TimedGRPOTrainer` times, the step's wall
    time, and its token counts (the same keys as our side's records)."""

    def __init__(self):
        self.steps: list[dict] = []
        self.current = self._blank()
        self.last_end = self.prepared_at = None

    @staticmethod
    def _blank() -> dict:
        return {key: 0.0 for key in PHASES} | {"tokens": 0}

    @contextlib.contextmanager
    def timed(self, key: str):
        sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync()
            self.current[key] += time.perf_counter() - t0

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_end = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        sync()
        now = time.perf_counter()
        self.current["step_s"] = now - self.last_end
        self.current["update_s"] += now - (self.prepared_at or self.last_end)
        self.prepared_at = None
        self.current["rss_bytes"] = peak_rss_now()  # before the step's checkpoint save (on_save comes later)
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # a GPU run: the same figures as ours
            self.current["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
            self.current["cuda_reserved_bytes"] = torch.cuda.max_memory_reserved()
        self.steps.append(self.current)
        self.current, self.last_end = self._blank(), now


class TimedGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose generation, reward and no-grad log-prob passes are timed by ``clock``."""

    def __init__(self, *args, clock: PhaseClock, **kwargs):
        self.clock = clock
        super().__init__(*args, callbacks=[clock], **kwargs)

    def _generate(self, prompts):
        with self.clock.timed("gen_s"):
            out = super()._generate(prompts)
        prompt_ids, completion_ids = out[0], out[1]
        self.clock.current["tokens"] += sum(len(ids) for ids in completion_ids)
        lengths = lambda rows: [len(ids) for ids in rows]
        self.clock.current.update(prompt_counts(lengths(prompt_ids), self.num_generations, lengths(completion_ids)))
        return out

    def _calculate_rewards(self, *args, **kwargs):
        with self.clock.timed("reward_s"):
            return super()._calculate_rewards(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if torch.is_grad_enabled():  # the loss forward: part of the update
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        with self.clock.timed("logprobs_s"):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    def _prepare_inputs(self, generation_batch):
        clock = self.clock
        if self.model.training and clock.prepared_at is not None:  # the previous micro-batch's forward + backward
            clock.current["update_s"] += time.perf_counter() - clock.prepared_at
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training:
            clock.prepared_at = time.perf_counter()
        return inputs


def build_trainer(workload: Workload, output_dir: str, reward) -> TimedGRPOTrainer:
    """The TRL trainer of the workload, scoring with ``reward`` (a ``MathReward``)."""
    from ngrpo_lightning.models.loading import load_tokenizer

    path = workload.model_path()
    peft_config = None
    if workload.lora_rank:  # the same adapters as ours: rank, alpha 2 x rank, every linear layer, no dropout
        from peft import LoraConfig

        r = workload.lora_rank
        peft_config = LoraConfig(
            r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    return TimedGRPOTrainer(
        model=path,
        peft_config=peft_config,
        reward_funcs=[math_reward(reward)],
        args=trl_config(workload, output_dir),
        train_dataset=trl_dataset(workload),
        processing_class=load_tokenizer(path),  # ours: the same chat template and pad token
        clock=PhaseClock(),
    )


def math_reward_of(workload: Workload):
    """Our side's reward, built from its config (verifier, answer extraction, workers)."""
    from ngrpo_lightning.build.components import build_reward

    return build_reward(ours_config(workload).reward)


def run(workload: Workload, options=None) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; ours: rollout.vllm.kv_cache_gib=1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with tempfile.TemporaryDirectory(prefix="trl-") as tmp, math_reward_of(workload) as reward:
        trainer = build_trainer(workload, tmp, reward)
        trainer.train()
    return {"steps": trainer.clock.steps}


if __name__ == "__main__":
    child_main(run)
