"""The CUDA backend: plain products, and the host looking at ended rows every few decoding steps
(``decode_checks_every``), not at every token.

Decoding on a static KV cache with each step replayed from a CUDA graph is built and checked on
the CPU (:mod:`ngrpo_lightning.rollout.static_cache`, :mod:`ngrpo_lightning.rollout.decode_graphs`,
``benchmarks/decoding_modes.py``); it becomes this backend's choice (``static_decoding = True``,
``decode_graphs = "cuda"``) once measured on a GPU (``benchmarks/gpu_checks.sh``, step 5).

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
