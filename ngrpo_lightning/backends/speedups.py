"""The backends' speed-ups, each registered by name, and which are on by default where.

A speed-up is one way a backend computes faster or in less memory than the plain model, with
the same values (bit for bit or to float rounding). Each lives in one module (``where``) and is
registered here once. A backend (:mod:`.base`) is the list of speed-ups it applies on its device;
``backend.disable=[name, ...]`` turns named ones off, for a comparison, and
``backend.enable=[name, ...]`` turns on one that is off by default there, to measure it.

**On by default only where measured.** A speed-up is on by default on a kind of device only
where a dated record in ``benchmarks/results/records/`` shows it paying there: the run with it
against the same run without it, on a named machine at a named commit. ``evidence`` names that
record per device; ``tests/test_speedup_records.py`` reads this registry and the records, and
fails on a default without one. Everything else is off by default and says so
(:func:`reasons`): ``python benchmarks/harness.py speedup NAME`` measures one and writes its record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ngrpo_lightning.registry import Registry


@dataclass
class SpeedUp:
    """One registered speed-up.

    Args:
        name: what ``backend.disable`` / ``backend.enable`` and ``describe`` call it.
        summary: what it does, in one line.
        where: the module that implements it.
        devices: the kinds of device whose backend can apply it.
        evidence: ``device -> record file`` (in ``benchmarks/results/records/``) for each device
            where it is on by default; a device absent here has it off by default.
        saves: ``"time"`` or ``"memory"``: what its record measures.
        parts: names its pieces were recorded under, where they were measured one by one.
    """

    name: str
    summary: str
    where: str
    devices: tuple[str, ...]
    evidence: dict[str, str] = field(default_factory=dict)
    saves: str = "time"
    parts: tuple[str, ...] = ()

    def default_on(self, device: str) -> bool:
        return device in self.evidence


SPEEDUPS = Registry("speed-up", key="backend.disable")


def register(speedup: SpeedUp) -> SpeedUp:
    """Register ``speedup`` under its name (a second, different one of the same name is refused)."""
    unknown = set(speedup.evidence) - set(speedup.devices)
    if unknown:
        raise ValueError(f"speed-up {speedup.name!r} has evidence for devices it does not apply on: {sorted(unknown)}")
    SPEEDUPS.register(speedup.name)(speedup)
    return speedup


def check_names(names, key: str, device: str, applies: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` (a list from ``backend.disable`` or ``backend.enable``) as a tuple, each one of the
    speed-ups ``applies`` of a backend on ``device``; ``ValueError`` naming ``key`` and the allowed
    names otherwise."""
    if names is None:
        return ()
    names = (names,) if isinstance(names, str) else tuple(str(n) for n in names)
    for name in names:
        if name not in applies:
            elsewhere = f" ({name} is a speed-up of {', '.join(SPEEDUPS[name].devices)})" if name in SPEEDUPS else ""
            raise ValueError(
                f"{key}={list(names)}: {name!r} is not a speed-up of the {device} backend{elsewhere}: "
                f"allowed {sorted(applies)}"
            )
    return names


def active(applies: tuple[str, ...], device: str, disable=(), enable=()) -> frozenset[str]:
    """The speed-ups among ``applies`` that are on: those on by default on ``device`` and those
    named in ``enable``, less those named in ``disable``."""
    on = {n for n in applies if SPEEDUPS[n].default_on(device)} | set(enable)
    return frozenset(on & set(applies)) - set(disable)


def reasons(applies: tuple[str, ...], on: frozenset[str], device: str, disable=(), enable=()) -> list[tuple]:
    """``(name, on, why)`` for each speed-up a backend applies, in its order."""
    rows = []
    for name in applies:
        s = SPEEDUPS[name]
        if name in disable:
            why = "off: backend.disable names it"
        elif name in enable and not s.default_on(device):
            why = f"on: backend.enable names it (off by default on {device}: not yet measured there)"
        elif s.default_on(device):
            why = f"on by default on {device}, measured: {s.evidence[device]}"
        else:
            why = f"off by default on {device}: not yet measured there (backend.enable=[{name}] to measure it)"
        rows.append((name, name in on, f"{s.summary}; {why}"))
    return rows


# ---------------------------------------------------------------- the registry
# Evidence: files in benchmarks/results/records/. measured_code-cuda-2026-11-27.json is the last code
# measured on a GPU (one H100): the speed-ups it lists stay on by default on CUDA until the newer ones
# are measured there (benchmarks/gpu_checks.sh); everything added after it is off by default on CUDA.
GPU_RUN = "measured_code-cuda-2026-11-27.json"
BOTH = ("cpu", "cuda")

for _speedup in (
    # every device's backend (backends/base.py)
    SpeedUp(
        "recompute_activations",
        "RMSNorm and gated-MLP outputs recomputed in backward instead of kept (bit-identical)",
        "ngrpo_lightning.backends.recompute",
        BOTH,
        {
            "cpu": "speedup-recompute_activations-cpu-2026-11-25.json",
            "cuda": "speedup-recompute_activations-cuda-2026-11-27.json",
        },
        saves="memory",
    ),
    SpeedUp(
        "lean_lora",
        "peft's LoRA layers summed in place, and decoding on a merged copy of each adapted weight",
        "ngrpo_lightning.backends.lora",
        BOTH,
        {"cpu": "speedup-lean_lora-cpu-2026-11-25.json", "cuda": GPU_RUN},
    ),
    SpeedUp(
        "chunked_logprobs",
        "the log-probs' LM head in chunks of tokens, its softmax kept for backward where it fits",
        "ngrpo_lightning.training.forward",
        BOTH,
        {"cpu": "speedup-chunked_logprobs-cpu-2026-11-23.json", "cuda": GPU_RUN},
        saves="memory",
        parts=("kept_softmax",),
    ),
    SpeedUp(
        "shared_prompts",
        "a group's common prompt run once per log-prob pass (on a GPU only where it saves more than it launches)",
        "ngrpo_lightning.training.forward",
        BOTH,
        {
            "cpu": "speedup-shared_prompts-cpu-2026-11-25.json",
            "cuda": "speedup-prompt_sharing_by_size-cuda-2026-11-27.json",
        },
        parts=("prompt_sharing_by_size",),
    ),
    # CPU (backends/cpu.py)
    SpeedUp(
        "packed_products",
        "products on oneDNN (weights packed for a rollout), per shape where this machine measures it faster",
        "ngrpo_lightning.backends.packing",
        ("cpu",),
        {"cpu": "speedup-packed_products-cpu-2026-12-06.json"},
    ),
    SpeedUp(
        "packed_logits",
        "the log-probs' LM head on oneDNN, logits and gradients, where this machine measures it faster",
        "ngrpo_lightning.backends.packing",
        ("cpu",),
        {"cpu": "speedup-packed_logits-cpu-2026-12-06-3.json"},
    ),
    SpeedUp(
        "grouped_attention",
        "attention sdpa_gqa: grouped KV heads read in place, decoding as two matmuls, the causal kernel where it pays",
        "ngrpo_lightning.backends.attention",
        ("cpu",),
        {"cpu": "speedup-gqa_in_place-cpu-2026-11-23.json"},
        parts=(
            "gqa_in_place",
            "stacked_decoding_attention",
            "causal_kernel",
            "half_precision_attention",
            "half_decoding_in_float32",
            "wide_kv_cache",
        ),
    ),
    SpeedUp(
        "reference_in_file",
        "the frozen KL reference in an unlinked file between its passes (one process, output_dir on a disk)",
        "ngrpo_lightning.backends.file_weights",
        ("cpu",),
        {"cpu": "speedup-reference_in_file-cpu-2026-11-25.json"},
        saves="memory",
    ),
    SpeedUp(
        "decoding_copy",
        "under FSDP2, rollouts on a kept copy of the gathered weights instead of through FSDP2's modules",
        "ngrpo_lightning.rollout.sharded_decoding",
        BOTH,
        {"cpu": "speedup-sharded_decoding_copy-cpu-2026-11-28.json"},
        parts=("sharded_decoding_copy", "sharded_copy_version_skip"),
    ),
    SpeedUp(
        "release_freed_memory",
        "the C library's freed pages handed back before a step's update and before a training forward's LM head",
        "ngrpo_lightning.backends.freed_memory",
        ("cpu",),
        {"cpu": "speedup-release_freed_memory-cpu-2026-12-06-3.json"},
        saves="memory",
    ),
    # CUDA (backends/cuda.py)
    SpeedUp(
        "stacked_decoding_attention",
        "a decoding step reads each grouped key and value head once (attention sdpa_gqa)",
        "ngrpo_lightning.backends.attention",
        ("cuda",),
        {"cuda": GPU_RUN},
    ),
    SpeedUp(
        "decode_graphs",
        "decoding on a kept static KV cache, the model's step replayed from a CUDA graph",
        "ngrpo_lightning.rollout.decode_graphs",
        ("cuda",),
        {"cuda": "speedup-decode_graphs-cuda-2026-11-27-4.json"},
        parts=("static_kv_cache",),
    ),
    SpeedUp(
        "whole_step_graphs",
        "with decode_graphs: the explorer, sampling and bookkeeping recorded in the graph too",
        "ngrpo_lightning.rollout.step_graphs",
        ("cuda",),
    ),
    SpeedUp(
        "fewer_host_checks",
        "the host looks at which rows ended every 8 decoding steps, not at every token",
        "ngrpo_lightning.rollout.hf_engine",
        ("cuda",),
        {"cuda": GPU_RUN},
    ),
    SpeedUp(
        "fused_norms_and_rotary",
        "torch's fused RMSNorm kernel; queries and keys rotated together, q, k, v one product in a rollout",
        "ngrpo_lightning.backends.fused",
        ("cuda",),
        {"cuda": "speedup-fused_norms-cuda-2026-11-27.json"},
        parts=("fused_norms", "fused_attention"),
    ),
    SpeedUp(
        "fewer_kernels_per_layer",
        "gate and up one product, residual sums inside the output products, weights joined on the device",
        "ngrpo_lightning.backends.joined",
        ("cuda",),
    ),
    SpeedUp(
        "joined_reference",
        "the frozen reference's q, k, v and gate, up joined as the policy's (with fewer_kernels_per_layer)",
        "ngrpo_lightning.backends.joined",
        ("cuda",),
    ),
    SpeedUp(
        "width_buckets",
        "masked attention passes at a bounded set of widths (one cuDNN plan per width)",
        "ngrpo_lightning.backends.width_buckets",
        ("cuda",),
    ),
):
    register(_speedup)
