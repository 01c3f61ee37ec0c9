"""The CUDA backend: plain products, decoding on a kept static KV cache with each step replayed
from a CUDA graph, its attention reading grouped key and value heads in place
(:func:`~.attention.stacked_decoding_attention`), and the host looking at ended rows every few
decoding steps (``decode_checks_every``), not at every token.

On a GPU a decoding step of a small model is hundreds of small kernels launched one by one from
Python; a CUDA graph replays them with one launch (:mod:`ngrpo_lightning.rollout.decode_graphs`,
on the fixed shapes of :mod:`ngrpo_lightning.rollout.static_cache`). Measured on one H200
(docs/performance.md, "On one GPU, from CUDA graphs"): the packaged model's decoding step, 32 rows
in bfloat16, 20.9 ms eager on the growing cache and 4.9 ms replayed, the same tokens and
log-probs; recording took 0.1 s. Where the explorer declares ``capturable`` (every built-in one
does) the whole step is recorded: the model, the explorer, sampling, the log-prob, the records, the
answer marker and the rows' ends (:mod:`ngrpo_lightning.rollout.step_graphs`). Otherwise only the
model's step is, and the rest runs between replays, on the device without waiting for the host
(``benchmarks/host_syncs.py``): a user-written explorer needs nothing to run under graphs.

Under FSDP2 the policy decodes on a plain copy of its gathered weights, rewritten in place at
each rollout, with graphs as above, where the copy takes at most a quarter of the GPU
(:meth:`CUDABackend.decodes_sharded_on_copy`, :mod:`ngrpo_lightning.rollout.sharded_decoding`);
else eagerly on the growing cache through FSDP2's modules, whose hooks graphs cannot record.

Its RMSNorms run torch's fused kernel, one kernel each way instead of eight forward and about
twenty in backward, and its attentions rotate queries and keys together, four kernels instead of
ten (:mod:`.fused`). In a rollout queries, keys and values are one product, and so are a gated
MLP's gate and up projections (:mod:`.joined`): once a policy sits on its GPU (not sharded),
those weights are re-homed as row blocks of one tensor (:meth:`CUDABackend.on_device`), so the
product reads them in place; and each decoder layer's two residual sums are made by the output
and down projections' products (``addmm``). A masked pass (a rollout's prefill, a log-prob or
training pass) computes its attention at one of a bounded set of widths (:mod:`.width_buckets`),
since cuDNN's attention builds a plan for every new shape and passes come at new widths.
Everything the base :class:`~.base.Backend` does applies
(LoRA's lean layers and merged decoding, chunked log-probs), with the LM head's softmax
recomputed in backward, never kept, and two choices made by size: the MLP's activations are
recomputed in backward only where keeping them would take a sizeable share of the GPU
(:meth:`CUDABackend.recomputes`), and a group's prompt runs once only in a pass where the
arithmetic that saves outweighs the second decoder pass's kernel launches
(:meth:`CUDABackend.shares_prompts`). What a GPU does differently belongs here, never in config
keys. ``backend.name`` names the alternatives a measurement needs.
"""

from __future__ import annotations

import torch

from ngrpo_lightning.backends import attention
from ngrpo_lightning.backends.base import BACKENDS, Backend, device_memory
from ngrpo_lightning.backends.fused import fused_mlps, fused_modules, join_projections
from ngrpo_lightning.backends.width_buckets import bucket_width


@BACKENDS.register("cuda")
class CUDABackend(Backend):
    device_type = "cuda"
    # transformers' sdpa, except that a decoding step reads each grouped key and value head once
    # instead of copying it per query head (attention.stacked_decoding_attention)
    default_attention = attention.NAME
    decode_checks_every = 8  # one host look per 8 decoding steps: the launch queue keeps running between
    static_decoding = True
    decode_graphs: str | None = "cuda"

    # Sharing a group's prompt runs the decoder twice, the prompts then the responses: each layer's
    # kernels are launched twice (44 more operations per Llama-style layer in a forward, counted on
    # the CPU, about as many again in backward). A pass of a small model on a GPU waits on those
    # launches, not on its arithmetic (at the packaged shape on an H200 the reference pass's kernels
    # ran for a tenth of its time, docs/performance.md), so sharing pays only where the prompt tokens
    # it leaves out cost more arithmetic than the launches it adds: at about 5 us per launch and
    # 400 TFLOP/s, where a layer's saved tokens x 2 x its parameters pass 44 x 5 us x 4e14 FLOP/s.
    # For 4 prompts x 8 samples of the built-in task (prompts of 66 tokens): the packaged 135M model
    # (3.5M parameters per layer) runs each row's prompt; Qwen2.5-1.5B (47M) shares in a pass of 32
    # rows, not in a micro-batch of one group; 7B (233M) shares in both. benchmarks/prompt_sharing.py
    # times both ways on a GPU; the constants are not yet checked there.
    launch_s = 5e-6
    matmul_flops = 4e14
    extra_launches_per_layer = 44

    # Recomputation (backends/recompute.py) trades kernels for memory: the update's forward and
    # backward dispatched 8,546 operations with it and 7,639 without, counted at the packaged shape
    # (benchmarks/update_ops.py), where a GPU pass waits on its launches. With the norms fused
    # (backends/fused.py) what it still saves is the MLP's act(gate), act(gate) * up and up: 3 x
    # intermediate values per token and layer. The CUDA backend recomputes them only where keeping
    # them for a micro-batch of train_rows tokens would take more than this share of the GPU's memory.
    recompute_above_share = 1 / 8
    # The LM head's softmax is recomputed in backward, never kept (the base keeps up to 512 MiB):
    # a few large kernels per chunk of 512 tokens (its product, exponentials), where keeping it
    # holds tokens x vocabulary float32 values from forward to backward, 240 MiB at the packaged
    # shape (1,280 response tokens x 49,152), the update's largest single tensor there. The
    # opposite of the MLP's choice above, for the same reason: what costs a GPU is kernels, not
    # arithmetic, and this recomputation is few kernels.
    keep_softmax_mib = 0
    # Under FSDP2 a rollout through the sharded policy runs FSDP2's hooks at every decoding step,
    # which graphs cannot record: decoding eagerly took 17x its bandwidth floor on one GPU, where
    # graphs took 4x. A plain copy of the gathered weights decodes from graphs, at the cost of the
    # full weights held between rollouts too; kept only where that is a minor share of the GPU.
    copy_within_share = 1 / 4

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._notes: list[str] = []
        if self.attention == attention.NAME:
            attention.register()

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
        fused_modules(model)  # before the base's recomputation, which then leaves the fused norms alone
        model = super().prepare(model, trains=trains, sharded=sharded)
        fused_mlps(model)  # after it: in front of a recomputing MLP, which keeps recomputing outside rollouts
        return model

    def kv_read_width(self, model: torch.nn.Module):
        """Eager decoding (FSDP2, ``cuda_eager``) reads its growing cache at the bucket width of its
        length, a view (:func:`~.width_buckets.bucket_width`): cuDNN's attention meets a few key
        lengths, not a new one at every step, and nothing is copied to pad them."""
        on_gpu = next(model.parameters()).is_cuda
        return bucket_width if on_gpu and self.attention == attention.NAME else None

    def on_device(self, model: torch.nn.Module) -> torch.nn.Module:
        """The weights of each attention's q, k, v and each gated MLP's gate, up re-homed as row blocks
        of one tensor (:func:`~.fused.join_projections`): a rollout multiplies each group as one product
        reading them in place, and a training or reference pass as one product. The same ``Parameter``
        objects, so the optimizer made before keeps them; done on the device, since moving a model
        gives each weight a storage of its own again. The frozen reference is joined too: its
        log-prob passes make one product per group, as the policy's do."""
        join_projections(model)
        return model

    def startup_notes(self) -> list[str]:
        return list(self._notes)

    def summary(self) -> str:
        graphs = "whole steps from CUDA graphs" if self.decode_whole_steps else "the model's step from CUDA graphs"
        how = {"cuda": graphs, "compile": "compiled by torch.compile"}.get(self.decode_graphs, "eagerly")
        return f"{super().summary()}, decoding {how}"


@BACKENDS.register("cuda_eager")
class CUDAEagerBackend(CUDABackend):
    """The CUDA backend decoding eagerly on the growing cache, each kernel launched from Python:
    the baseline the graphs are measured against (``backend.name=cuda_eager``), and the way round
    a GPU or driver where recording fails."""

    static_decoding = False
    decode_graphs = None


@BACKENDS.register("cuda_model_step")
class CUDAModelStepBackend(CUDABackend):
    """CUDA graphs of the model's decoding step alone, the explorer, sampling and bookkeeping
    launched between replays, whatever the explorer declares (``backend.name=cuda_model_step``):
    the baseline whole-step graphs are measured against, and the way round a GPU where a whole step
    cannot be recorded but the model's step can."""

    decode_whole_steps = False


@BACKENDS.register("cuda_compile")
class CUDACompileBackend(CUDABackend):
    """The static-cache decoding step compiled by ``torch.compile`` (``mode="reduce-overhead"``:
    Inductor's fused kernels in CUDA graphs torch records per shape) instead of recorded as it
    runs eagerly (``backend.name=cuda_compile``): fewer kernels per step, but at the packaged
    shape compiling had not finished after 40 s, where recording took 0.1 s (docs/performance.md)."""

    decode_graphs = "compile"
