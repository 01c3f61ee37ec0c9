"""The CUDA backend: eager decoding, plain products, and the host looking at ended rows every few
steps (``decode_checks_every``), not at every token.

Everything the base :class:`~.base.Backend` does applies (recomputation, LoRA's lean layers and
merged decoding, chunked log-probs, shared prompts). What a GPU does differently belongs here:
decoding replayed from CUDA graphs on a static KV cache is the next step (docs/performance.md,
"On one GPU"); its choices will be made here, not as config keys.
"""

from __future__ import annotations

from ngrpo_lightning.backends.base import BACKENDS, Backend


@BACKENDS.register("cuda")
class CUDABackend(Backend):
    device_type = "cuda"
    default_attention = "sdpa"
    decode_checks_every = 8  # one host look per 8 decoding steps: the launch queue keeps running between
