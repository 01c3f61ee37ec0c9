"""The CUDA backend: eager decoding and plain products for now.

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
