"""The CPU backend: products on oneDNN-packed weights where this machine runs them faster.

Whether packing pays depends on the CPU (vector units, oneDNN kernels) and the shape (docs/performance.md, "Packed
products, measured per machine"). So when a run is built every distinct linear shape is timed both ways at three kinds
of product (:class:`~.linear.BackendLinear`): a decoding step's rows (``pack_once``), a frozen pass's rows
(``pack_frozen``) and a training forward and backward (``pack_per_product``); packed is taken where it takes at most
:data:`MARGIN` of the plain time. The answers are kept per machine (:mod:`.probe`). Also chosen here, same values:

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
from ngrpo_lightning.backends.linear import PackedLinearFunction, pack, packed_linear, packing_available
from ngrpo_lightning.backends.probe import Measurements, faster, median_seconds

MARGIN = 0.97  # packed is taken where it takes at most this share of the plain product's time
# A training product's relative speed settles by about a thousand rows: larger passes are timed at this many
TRAIN_ROWS_TIMED = 1024
HALF = (torch.bfloat16, torch.float16)
PACKING = ("auto", "on", "off")


def _bucket(rows: int) -> int:
    """Rows rounded up to a power of two: one measurement serves nearby batch sizes."""
    return 1 << max(0, int(rows) - 1).bit_length()


def measure_decode(out_features: int, in_features: int, dtype: torch.dtype, rows: int) -> dict:
    """A decoding step's product of ``rows`` rows: plain against one packed copy."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    packed = pack(weight, rows)
    with torch.inference_mode():
        t = faster(lambda: torch.nn.functional.linear(x, weight), lambda: packed_linear(x, packed))
    return {"plain_s": t["a_s"], "packed_s": t["b_s"]}


def measure_frozen(out_features: int, in_features: int, dtype: torch.dtype, rows: int) -> dict:
    """A frozen pass's product of ``rows`` rows (no autograd): plain against one packed copy."""
    return measure_decode(out_features, in_features, dtype, rows)


def measure_train(out_features: int, in_features: int, dtype: torch.dtype, rows: int) -> dict:
    """A training forward and backward of ``rows`` rows: plain against packed per product."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype).requires_grad_()
    x = torch.randn(rows, in_features, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(rows, out_features, generator=gen).to(dtype)

    def run(product):
        def step():
            y = product(x, weight, None)
            torch.autograd.grad(y, (x, weight), grad)

        return step

    t = faster(run(torch.nn.functional.linear), run(PackedLinearFunction.apply), rounds=2, budget_s=0.04)
    return {"plain_s": t["a_s"], "packed_s": t["b_s"]}


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
                why = f"plain products: oneDNN cannot pack {w.dtype} weights on {w.device}"
                out[id(m)] = (False, False, False, why)
                continue
            out[id(m)] = self._shape_choice(w.shape[0], w.shape[1], w.dtype, decoding_only=m is head)
        return out

    def _shape_choice(
        self, n: int, k: int, dtype: torch.dtype, decoding_only: bool = False
    ) -> tuple[bool, bool, bool, str]:
        name = str(dtype).removeprefix("torch.")
        if self.packing != "auto":
            on = self.packing == "on"
            return on, on, on, f"packed products {'forced on' if on else 'forced off'} ({n}x{k} {name})"
        decode_rows, train_rows = _bucket(self.decode_rows), min(_bucket(self.train_rows), TRAIN_ROWS_TIMED)
        answers = _Recording(self._answers(), self._used)
        d = answers.get(f"decode:{name}:{n}x{k}:{decode_rows}", lambda: measure_decode(n, k, dtype, decode_rows))
        if decoding_only:  # the LM head: only a rollout calls it
            once = d["packed_s"] <= MARGIN * d["plain_s"]
            why = f"{n}x{k} {name}, measured on this CPU: decoding {decode_rows} rows {'packed' if once else 'plain'}"
            return once, False, False, why + f" ({d['packed_s'] / d['plain_s']:.2f}x the plain time)"
        f = answers.get(f"frozen:{name}:{n}x{k}:{train_rows}", lambda: measure_frozen(n, k, dtype, train_rows))
        t = answers.get(f"train:{name}:{n}x{k}:{train_rows}", lambda: measure_train(n, k, dtype, train_rows))
        once, frozen, per_product = (r["packed_s"] <= MARGIN * r["plain_s"] for r in (d, f, t))
        self._chosen[f"{n}x{k}"] = (once, frozen, per_product)

        def say(what: str, rows: int, packed: bool, r: dict) -> str:
            return f"{what} {rows} rows {'packed' if packed else 'plain'} ({r['packed_s'] / r['plain_s']:.2f}x)"

        why = (
            f"{n}x{k} {name}, measured on this CPU (packed time / plain time): "
            f"{say('decoding', decode_rows, once, d)}, {say('frozen pass', train_rows, frozen, f)}, "
            f"{say('training per product', train_rows, per_product, t)}"
        )
        return once, frozen, per_product, why

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
                f"packed products ({torch.backends.cpu.get_cpu_capability()}, measured): decoding {once}/{total} "
                f"shapes, frozen passes {frozen}/{total}, training {per}/{total}"
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
