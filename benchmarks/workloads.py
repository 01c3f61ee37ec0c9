"""The workloads the benchmarks run, by name, and the ``ngrpo train`` command line of each.

* ``default``: the main job, ``ngrpo train`` with its defaults (the packaged model, the built-in
  task); only the number of steps and ``extra`` overrides change, validation before training is off.
* ``side_by_side``: the workload run against TRL's GRPOTrainer: the packaged model in float32,
  4 prompts x 8 completions of exactly 40 tokens (EOS suppressed), temperature 1, GRPO with a k3
  KL term of 0.001 to a frozen reference, one fused AdamW step at 2e-5 per rollout batch,
  gradients clipped at 1, the Hugging Face engine, 2 threads.

:data:`SHAPES` are the published shapes of larger models, built randomly initialised
(``shapes.py``): a step's speed and memory do not depend on the weights' values.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

LORA_RANK = 16  # a "lora" run's adapters: rank 16, alpha 32, every linear layer (experiment=ngrpo-lora's)


@dataclass(frozen=True)
class Workload:
    """One training job; the defaults are the side-by-side workload."""

    name: str = "side_by_side"  # side_by_side | default (the fields below but steps and extra unused)
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    prompts: int = 4  # prompts per step
    group: int = 8  # completions per prompt
    tokens: int = 40  # new tokens per completion (exactly, unless natural)
    natural: bool = False  # EOS on: natural lengths, at most `tokens`
    temperature: float = 1.0
    kl_coef: float = 0.001
    lr: float = 2e-5
    steps: int = 5  # optimizer steps per run
    engine: str = "hf"  # hf | vllm
    threads: int = 2  # torch threads of a run's process (0: the backend's own choice)
    seed: int = 0
    saves: bool = True  # checkpoints as each side's defaults save them (False: none on either side)
    activation_checkpointing: bool = False  # TRL's side only (the trl-ac side)
    lora_rank: int = 0  # > 0: LoRA adapters of this rank (alpha 2 x rank) on every linear layer
    micro_batch: int = 0  # rows per forward/backward of the update (0: the whole batch at once)
    problems: str = ""  # a .jsonl of problems (data=files) instead of the built-in task
    accelerator: str = "cpu"  # cpu | gpu
    extra: tuple[str, ...] = ()  # this project's side only: more `ngrpo train` overrides, last

    def model_path(self) -> str:
        """The local model directory the run loads (a packaged model is built once)."""
        from ngrpo_lightning.models.loading import resolve_model_path

        return resolve_model_path(self.model)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Workload:
        fields = json.loads(text)
        return cls(**{**fields, "extra": tuple(fields.get("extra", ()))})


def describe(w: Workload) -> str:
    """The workload in words, for a record."""
    parts = [f"LoRA rank {w.lora_rank}"] if w.lora_rank else []
    if w.name == "default":
        parts = ["ngrpo train's defaults", f"{w.steps} steps", "no validation before", *parts]
    else:
        length = f"at most {w.tokens}" if w.natural else str(w.tokens)
        parts = [Path(w.model).name, w.dtype, f"{w.prompts} prompts x {w.group} completions of {length} tokens",
                 *([f"micro-batches of {w.micro_batch}"] if w.micro_batch else []), *parts, f"{w.steps} steps",
                 f"{w.threads} threads" if w.threads else "the backend's threads", w.accelerator,
                 *([] if w.saves else ["no checkpoints"])]  # fmt: skip
    return f"{w.name}: " + ", ".join(parts) + (f"; {' '.join(w.extra)}" if w.extra else "")


def default_job(**changes) -> Workload:
    """The main job: ``ngrpo train``'s defaults, 4 steps."""
    return Workload(**{"name": "default", "steps": 4, "threads": 0, **changes})


def side_by_side(**changes) -> Workload:
    """The workload run against TRL's GRPOTrainer."""
    return Workload(**changes)


WORKLOADS = {"default": default_job, "side_by_side": side_by_side}


def lora_overrides(rank: int) -> list[str]:
    if not rank:
        return []
    return ["model.lora.enabled=true", f"model.lora.rank={rank}", f"model.lora.alpha={2 * rank}",
            "model.lora.target_modules=all-linear"]  # fmt: skip


def train_overrides(w: Workload, output_dir: str) -> list[str]:
    """The ``ngrpo train`` command line of ``w``, writing under ``output_dir``."""
    if w.name == "default":
        store = f"logger.tracking_uri=sqlite:///{output_dir}/mlruns.db"
        return [f"trainer.max_steps={w.steps}", "validate_before_fit=false", f"output_dir='{output_dir}'", store,
                *lora_overrides(w.lora_rank), *w.extra]  # fmt: skip
    data = ["data=files", f"data.train='{w.problems}'"] if w.problems else ["data.val_size=0"]
    saves = [] if w.saves else ["trainer.enable_checkpointing=false", "checkpoint.every_n_steps=0"]
    return [
        f"model.name_or_path='{w.model_path()}'", f"model.dtype={w.dtype}", *data,
        f"data.prompts_per_step={w.prompts}", f"rollout.group_size={w.group}",
        f"rollout.max_new_tokens={w.tokens}", f"rollout.engine={w.engine}",
        f"rollout.ignore_eos={str(not w.natural).lower()}",
        "explorer=temperature", f"explorer.temperature={w.temperature}",
        "objective=grpo", f"objective.kl_coef={w.kl_coef}", "objective.kl_estimator=k3",
        f"optim.lr={w.lr}", f"optim.micro_batch_size={w.micro_batch}", "optim.warmup_steps=0",
        "train.ppo_epochs=1", "train.num_mini_batches=1", f"trainer.max_steps={w.steps}", *saves,
        "trainer.enable_progress_bar=false", "logger=none", "validate_before_fit=false", "pass_at_k.n=0",
        f"output_dir='{output_dir}'", f"seed={w.seed}", f"trainer={w.accelerator}",
        *lora_overrides(w.lora_rank), *w.extra,
    ]  # fmt: skip


# Settings that are not the backend's speed-ups, compared the same way: (overrides on, overrides off).
SETTINGS = {"nondeterministic": ((), ("trainer.deterministic=true",))}  # Lightning's and the backend's free choices


def arms(w: Workload, speedup: str) -> tuple[Workload, Workload]:
    """``w`` with the speed-up ``speedup`` on and with it off: one of :data:`SETTINGS`, else one of
    the backend's speed-ups (``backend.enable=[NAME]``: on even where it is off by default;
    ``backend.disable=[NAME]``)."""
    on, off = SETTINGS.get(speedup, ((f"backend.enable=[{speedup}]",), (f"backend.disable=[{speedup}]",)))
    return replace(w, extra=(*w.extra, *on)), replace(w, extra=(*w.extra, *off))


# Published shapes (each model's config.json); None: the packaged model's own config.
SHAPES: dict[str, dict | None] = {
    "smollm2-135m": None,
    "qwen2.5-1.5b": dict(
        model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
    "qwen2.5-7b": dict(  # also DeepSeek-R1-Distill-Qwen-7B's shape (experiment=n-grpo-7b-lora)
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
        max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
}  # fmt: skip
