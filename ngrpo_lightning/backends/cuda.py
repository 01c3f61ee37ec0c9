"""The CUDA backend: plain products, and the host looking at ended rows every few decoding steps
(``decode_checks_every``), not at every token.

Between those looks nothing in the decoding loop waits for the host: the built-in explorers,
the records and the answer marker stay on the device (``benchmarks/host_syncs.py``), and
neighbor mixing fills its whole table when its index is built. Decoding on a static KV cache,
each step replayed from a CUDA graph kept across rollouts, is built and checked on the CPU
(:mod:`ngrpo_lightning.rollout.static_cache`, :mod:`ngrpo_lightning.rollout.decode_graphs`); it
becomes this backend's choice (``static_decoding = True``, ``decode_graphs = "cuda"``) once
measured on a GPU (``benchmarks/gpu_checks.sh``, step 5). Neither cache's forward waits per
token inside transformers: the engine hands the growing cache's decoding steps their mask
ready-made, and the static cache's mask has a fixed width.

Everything the base :class:`~.base.Backend` does applies (recomputation, LoRA's lean layers and
merged decoding, chunked log-probs, shared prompts). What a GPU does differently belongs here,
never in config keys.
"""

from __future__ import annotations

from ngrpo_lightning.backends.base import BACKENDS, Backend


@BACKENDS.register("cuda")
class CUDABackend(Backend):
    device_type = "cuda"
    default_attention = "sdpa"
    decode_checks_every = 8  # one host look per 8 decoding steps: the launch queue keeps running between


@BACKENDS.register("cuda_graphs")
class CUDAGraphsBackend(CUDABackend):
    """The CUDA backend decoding on kept static caches, each step replayed from a CUDA graph: what
    :class:`CUDABackend` becomes once a GPU has measured it faster (``backend.name=cuda_graphs``
    selects it for that measurement; the same rollouts, tested on the CPU up to the graphs)."""

    static_decoding = True
    decode_graphs = "cuda"


@BACKENDS.register("cuda_compile")
class CUDACompileBackend(CUDABackend):
    """:class:`CUDAGraphsBackend` with the decoding step compiled by ``torch.compile`` (fused
    kernels, CUDA graphs recorded by torch) instead of recorded as it runs eagerly: the other
    way the issue of graph decoding left to measurement (``backend.name=cuda_compile``)."""

    static_decoding = True
    decode_graphs = "compile"
