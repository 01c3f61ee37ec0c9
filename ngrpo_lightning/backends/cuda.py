"""The CUDA backend: plain products, decoding steps replayed from CUDA graphs, fewer kernels per layer.

A small model's decoding step is hundreds of small kernels launched from Python; a CUDA graph replays them with one
launch (:mod:`ngrpo_lightning.rollout.decode_graphs`, on :mod:`ngrpo_lightning.rollout.static_cache`'s fixed shapes),
the same tokens and log-probs: the whole step where the explorer is ``capturable`` (every built-in one,
:mod:`ngrpo_lightning.rollout.step_graphs`), else the model's step alone. Decoding attention reads grouped KV heads in
place (:func:`~.attention.stacked_decoding_attention`); the host looks at ended rows every few steps
(``decode_checks_every``). Under FSDP2 the policy decodes on a plain copy of its gathered weights, with graphs, where
it fits ``copy_within_share`` of the GPU (:mod:`ngrpo_lightning.rollout.sharded_decoding`); else eagerly.

Fewer kernels per layer (:mod:`.fused`, :mod:`.joined`): fused RMSNorms, queries and keys rotated together, and in a
rollout q, k, v as one product, gate and up as one, the residual sums made by the output and down products; the joined
weights are re-homed as row blocks of one tensor (:meth:`CUDABackend.on_device`). Masked passes compute attention at a
bounded set of widths (:mod:`.width_buckets`), since cuDNN plans every new shape. Unlike :class:`~.base.Backend`, the
LM head's softmax is never kept; :meth:`CUDABackend.recomputes` and :meth:`CUDABackend.shares_prompts` decide by size.
What a GPU does differently belongs here, never in config keys (docs/measurements.md).
"""

from __future__ import annotations

import warnings

import torch

from ngrpo_lightning.backends import attention
from ngrpo_lightning.backends.base import BACKENDS, Backend, device_memory
from ngrpo_lightning.backends.fused import fused_mlps, fused_modules, join_projections
from ngrpo_lightning.backends.width_buckets import bucket_width


@BACKENDS.register("cuda")
class CUDABackend(Backend):
    device_type = "cuda"
    # transformers' sdpa, except that a decoding step reads each grouped KV head once (stacked_decoding_attention)
    default_attention = attention.NAME
    attention_speedup = "stacked_decoding_attention"
    speedups = (
        *Backend.speedups,
        "stacked_decoding_attention",
        "decode_graphs",
        "whole_step_graphs",
        "fewer_host_checks",
        "fused_norms_and_rotary",
        "fewer_kernels_per_layer",
        "joined_reference",
        "width_buckets",
        "decoding_copy",
    )
    graph_kind = "cuda"  # how decode_graphs replays a step: "cuda" records it as it runs, "compile" compiles it

    # Sharing a prompt launches each layer's kernels twice: it pays where a layer's saved tokens x 2 x parameters at
    # matmul_flops outlast extra_launches_per_layer launches of launch_s (benchmarks/harness.py speedup shared_prompts)
    launch_s = 5e-6
    matmul_flops = 4e14
    extra_launches_per_layer = 44

    # The MLP's act(gate), act(gate) * up and up (3 x intermediate per token and layer) are recomputed only where
    # keeping them for train_rows tokens would take more than this share of the GPU (recomputing costs kernels).
    recompute_above_share = 1 / 8
    # LM-head softmax (tokens x V float32, the largest tensor) recomputed in a few large kernels per chunk, never kept
    keep_softmax_mib = 0
    # FSDP2's hooks cannot be graphed; a plain decoding copy can, held between rollouts: only within this GPU share
    copy_within_share = 1 / 4

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._notes: list[str] = []
        self.static_decoding = self.uses("decode_graphs")  # fixed shapes a CUDA graph can replay
        self.decode_graphs: str | None = self.graph_kind if self.static_decoding else None
        self.decode_whole_steps = self.uses("whole_step_graphs")
        self.decode_checks_every = 8 if self.uses("fewer_host_checks") else 1  # the launch queue runs on between
        if not self.uses("decoding_copy"):
            self.copy_within_share = None
        if self.attention == attention.NAME:
            attention.register(buckets=self.uses("width_buckets"))

    def shares_prompts(self, saved_tokens: int, layer_params: int) -> bool:
        saved_s = saved_tokens * 2 * layer_params / self.matmul_flops
        return self.share_prompts and saved_s > self.extra_launches_per_layer * self.launch_s

    def recomputes(self, model: torch.nn.Module) -> bool:
        if not torch.cuda.is_available():
            return True  # no GPU to weigh it against: keep the memory
        return self.recomputes_within(model, device_memory(torch.device("cuda", torch.cuda.current_device()))[0])

    def recomputes_within(self, model: torch.nn.Module, memory_bytes: int) -> bool:
        """Whether ``model`` recomputes its MLP activations on a GPU of ``memory_bytes``."""
        config = getattr(model, "config", None)
        width, layers = getattr(config, "intermediate_size", None), getattr(config, "num_hidden_layers", None)
        param = next(model.parameters(), None)
        if not (isinstance(width, int) and isinstance(layers, int)) or param is None:
            return True  # a model of unknown shape: keep the memory
        kept = 3 * width * layers * self.train_rows * param.element_size()
        return kept > self.recompute_above_share * memory_bytes

    def decodes_sharded_on_copy(self, copy_bytes: int, device: torch.device) -> bool:
        """Only where decoding replays graphs, what the copy is for (``cuda_eager``: the baseline)."""
        return (
            self.decode_graphs is not None
            and torch.cuda.is_available()
            and super().decodes_sharded_on_copy(copy_bytes, device)
        )

    def prepare(self, model: torch.nn.Module, trains: bool = False, sharded: bool = False) -> torch.nn.Module:
        if sharded and trains and self.decode_graphs is not None:
            self._notes.append(
                "under FSDP2 rollouts decode on a copy of the gathered weights, with CUDA graphs, where the "
                f"copy takes at most {self.copy_within_share:.0%} of the GPU; else eagerly through FSDP2's modules"
            )
        layers = self.uses("fewer_kernels_per_layer")
        if self.uses("fused_norms_and_rotary"):  # before the base's recomputation, which then leaves them alone
            fused_modules(model, decoder_layers=layers)
        model = super().prepare(model, trains=trains, sharded=sharded)
        if layers:  # after it: in front of a recomputing MLP, which keeps recomputing outside rollouts
            fused_mlps(model)
        return model

    def kv_read_width(self, model: torch.nn.Module):
        """Eager decoding (FSDP2, ``cuda_eager``) reads its growing cache at the bucket width of its length, a view
        (:func:`~.width_buckets.bucket_width`): cuDNN meets a few key lengths, not a new one at every step."""
        on_gpu = next(model.parameters()).is_cuda
        return bucket_width if on_gpu and self.attention == attention.NAME and self.uses("width_buckets") else None

    def on_device(self, model: torch.nn.Module, reference: bool = False) -> torch.nn.Module:
        """Re-home each attention's q, k, v and gated MLP's gate, up as row blocks of one tensor, the same
        ``Parameter`` objects (:func:`~.fused.join_projections`); on the device, since moving a model gives each
        weight its own storage again. The reference too with ``joined_reference``."""
        if self.uses("fewer_kernels_per_layer") and (not reference or self.uses("joined_reference")):
            join_projections(model)
        return model

    def startup_notes(self) -> list[str]:
        return [*super().startup_notes(), *self._notes]

    def summary(self) -> str:
        graphs = "whole steps from CUDA graphs" if self.decode_whole_steps else "the model's step from CUDA graphs"
        how = {"cuda": graphs, "compile": "compiled by torch.compile"}.get(self.decode_graphs, "eagerly")
        return f"{super().summary()}, decoding {how}"


class _DeprecatedName(CUDABackend):
    """A backend name that ``backend.disable`` replaced: the CUDA backend with ``disables`` off, and a
    ``DeprecationWarning`` naming the setting to use."""

    disables: tuple[str, ...] = ()

    def __init__(self, *args, disable=(), **kwargs):
        names = ", ".join(self.disables)
        warnings.warn(
            f"backend.name={self.registered_name} is deprecated: use backend.name=cuda backend.disable=[{names}]",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(*args, disable=(*(disable or ()), *self.disables), **kwargs)


@BACKENDS.register("cuda_eager")
class CUDAEagerBackend(_DeprecatedName):
    """Deprecated: ``backend.disable=[decode_graphs]`` (eager decoding on the growing cache)."""

    disables = ("decode_graphs",)


@BACKENDS.register("cuda_model_step")
class CUDAModelStepBackend(_DeprecatedName):
    """Deprecated: ``backend.disable=[whole_step_graphs]`` (graphs of the model's step alone)."""

    disables = ("whole_step_graphs",)


@BACKENDS.register("cuda_compile")
class CUDACompileBackend(CUDABackend):
    """The static-cache decoding step compiled by ``torch.compile`` (``mode="reduce-overhead"``) instead of
    recorded as it runs (``backend.name=cuda_compile``): fewer kernels per step, far longer to compile."""

    graph_kind = "compile"
