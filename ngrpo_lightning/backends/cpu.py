"""The CPU backend: products on oneDNN (packed weights in a rollout) where this machine runs them faster.

Whether oneDNN pays depends on the CPU (vector units, oneDNN kernels) and the shape, so when a run is built every
distinct linear shape is timed both ways at a decoding step's rows, a frozen pass's and a training forward and
backward, and the LM head at its log-prob chunks (``packed_logits``) (:func:`~.packing.choose`), the answers kept per
machine (:mod:`.probe`). Also chosen here, same values:

- attention ``sdpa_gqa`` (:mod:`ngrpo_lightning.backends.attention`): grouped KV heads read in place;
- a half-precision rollout keeps its KV cache in float32 for ``sdpa_gqa``, which decodes in float32;
- the frozen KL reference in an unlinked file between its passes on a one-process Linux run whose ``output_dir`` is
  on a disk (:mod:`ngrpo_lightning.backends.file_weights`);
- under FSDP2, rollouts on a copy of the policy's gathered weights (packed products, no FSDP2 hooks) where every
  process's copy together takes at most ``copy_within_share`` of RAM (:mod:`ngrpo_lightning.rollout.sharded_decoding`).

A half-precision model on a CPU without native bfloat16 products is warned about at start-up, with both rates.
"""

from __future__ import annotations

import torch

from ngrpo_lightning.backends import attention, file_weights
from ngrpo_lightning.backends.base import BACKENDS, Backend
from ngrpo_lightning.backends.packing import Choice, choose, packing_available
from ngrpo_lightning.backends.probe import Measurements, median_seconds

HALF = (torch.bfloat16, torch.float16)
PACKING = ("auto", "on", "off")


def matmul_rate(dtype: torch.dtype, size: int = 512) -> float:
    """GFLOP/s of a [size, size] x [size, size] product in ``dtype``."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    return 2 * size**3 / median_seconds(lambda: a @ b, budget_s=0.1, least=2) / 1e9


@BACKENDS.register("cpu")
class CPUBackend(Backend):
    """Models on the CPU (see the module docstring). ``measurements``: where answers are kept (default: this
    machine's file); ``packing``: ``auto`` (measured), or ``on`` / ``off`` to force either way."""

    device_type = "cpu"
    default_attention = attention.NAME
    # LM-head softmax recomputed, not kept: more peak memory for little time (docs/performance.md, "The allocator")
    keep_softmax_mib = 0
    attention_speedup = "grouped_attention"
    chooses_packing = True
    speedups = (
        *Backend.speedups,
        "packed_products",
        "packed_logits",
        "grouped_attention",
        "reference_in_file",
        "decoding_copy",
        "release_freed_memory",
    )

    def __init__(self, *args, measurements: Measurements | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.packing not in PACKING:
            raise ValueError(f"backend.packing={self.packing!r}: allowed {', '.join(PACKING)}")
        if not self.uses("packed_products") and self.packing == "auto":
            self.packing = "off"
        if not self.uses("decoding_copy"):
            self.copy_within_share = None
        self.measurements = measurements
        if self.attention == attention.NAME:
            attention.register()
        self._chosen: dict[str, tuple[bool, bool, bool]] = {}  # shape -> what was chosen, for the header
        self._head_logits: bool | None = None  # whether the LM head's log-prob products pack (None: no head seen)
        self._used: dict[str, dict] = {}  # the measured answers the choices came from (recorded_choices)

    def _answers(self) -> Measurements:
        if self.measurements is None:
            self.measurements = Measurements()
        return self.measurements

    def linear_choices(self, layers, head=None):
        out = {}
        for m in layers:
            w = m.weight
            if w.device.type != "cpu" or not packing_available(w.dtype):
                out[id(m)] = Choice(
                    False, False, False, f"plain products: oneDNN cannot pack {w.dtype} weights on {w.device}"
                )
                continue
            out[id(m)] = self._shape_choice(w.shape[0], w.shape[1], w.dtype, head=m is head)
        return out

    def _shape_choice(self, n: int, k: int, dtype: torch.dtype, head: bool = False) -> Choice:
        name = str(dtype).removeprefix("torch.")
        if self.packing != "auto":
            on = self.packing == "on"
            why = f"packed products {'forced on' if on else 'forced off'} ({n}x{k} {name})"
            return Choice(on, on, on, why, on and self.uses("packed_logits"))
        answers = _Recording(self._answers(), self._used)
        head_rows = ((self.logprob_chunk_size or 0) if self.uses("packed_logits") else 0) if head else None
        choice = choose(answers, n, k, dtype, self.decode_rows, self.train_rows, head_rows)
        if head:
            self._head_logits = choice.logits
        else:
            self._chosen[f"{n}x{k}"] = choice[:3]
        return choice

    def recorded_choices(self) -> dict:
        return {"packing": self.packing, "measured": dict(self._used)} if self._used else {}

    def use_recorded(self, choices: dict) -> None:
        if choices.get("measured") and self.packing == "auto":
            self.measurements = Measurements.recorded(choices["measured"])

    def kv_cache_dtype(self, model):
        wide = self.attention == attention.NAME and next(model.parameters()).dtype in HALF
        return torch.float32 if wide else None

    def reference_in_file(self, output_dir, sharded: bool) -> bool:
        return self.uses("reference_in_file") and file_weights.resolve("auto", "cpu", sharded, output_dir) == "file"

    copy_within_share = 1 / 8  # of the machine's memory, for every process's copy together

    def startup_notes(self) -> list[str]:
        notes = super().startup_notes()
        if self.dtype in HALF:
            half, single = matmul_rate(self.dtype), matmul_rate(torch.float32)
            if half < 0.5 * single:
                notes.append(
                    f"warning: model.dtype={str(self.dtype).removeprefix('torch.')} on this CPU "
                    f"({torch.backends.cpu.get_cpu_capability()}) multiplies at {half:.0f} GFLOP/s against "
                    f"{single:.0f} in float32 (no native half-precision products): model.dtype=float32 is faster here"
                )
        if self._chosen:
            once, frozen, per = (sum(c[i] for c in self._chosen.values()) for i in range(3))
            total = len(self._chosen)
            notes.append(
                f"oneDNN products ({torch.backends.cpu.get_cpu_capability()}, measured): decoding {once}/{total} "
                f"shapes packed, frozen passes {frozen}/{total} packed, training {per}/{total}"
                + (
                    ""
                    if self._head_logits is None
                    else f"; the LM head's log-prob products {'on oneDNN' if self._head_logits else 'plain'}"
                )
            )
        return notes

    def summary(self) -> str:
        return f"cpu backend ({torch.backends.cpu.get_cpu_capability()}), attention {self.attention}"


class _Recording:
    """Measurements that note each answer they hand out (the choices a run made)."""

    def __init__(self, measurements: Measurements, used: dict):
        self.measurements, self.used = measurements, used

    def get(self, key: str, measure) -> dict:
        self.used[key] = self.measurements.get(key, measure)
        return self.used[key]
