"""``sdpa_gqa``: transformers' SDPA attention, with grouped KV heads read in place on CPU.

Models with grouped-query attention (SmolLM2, Qwen2, Llama 3: fewer key/value heads than
query heads) reach ``torch.nn.functional.scaled_dot_product_attention`` through transformers'
``sdpa`` attention. When a padding mask is given, which is every batched rollout and
log-prob pass here, transformers first copies each key/value head once per query head of its
group (``repeat_kv``), because CUDA's fast kernels need that. PyTorch's CPU kernel takes the
grouped heads as they are (``enable_gqa=True``) and gives the same values and gradients
without the copies: on the packaged model that is 60 copies of the KV cache per decoding step
and per forward. So on CPU this function passes ``enable_gqa``; on every other device, and
for models without grouped heads, it is transformers' ``sdpa`` unchanged.

A bfloat16 decoding step (one query per row) runs its attention in float32: on this CPU the
bfloat16 kernel took 2.7x the float32 one's time at one query (1.60 against 0.59 s for a
40-token rollout of 32 rows; casting the keys and values up costs less), so a bfloat16
rollout decoded in 2.26-2.39 s instead of 3.38-3.40 (float32: 3.75). Longer queries (prefill,
log-prob passes) keep bfloat16.

It is registered with transformers (``AttentionInterface``, with ``sdpa``'s mask builder) as
``sdpa_gqa`` and is the default of ``model.attn_implementation``; any name transformers
knows (``sdpa``, ``eager``, ``flash_attention_2``) can be set there instead.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "sdpa_gqa"


def sdpa_gqa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature: query [B, H, Lq, d], key/value [B, H_kv, Lk, d];
    returns ([B, Lq, H, d], None)."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = (
        query.device.type != "cpu" or not grouped or attention_mask is None or kwargs.get("position_bias") is not None
    )
    if plain or kwargs.get("cache") is not None or kwargs.get("output_attentions", False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    dtype = query.dtype
    if dtype == torch.bfloat16 and query.shape[-2] == 1:  # a decoding step: see the module docstring
        query, key, value = query.float(), key.float(), value.float()
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.to(dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, sdpa_gqa_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def check_attn_implementation(name) -> None:
    """``model.attn_implementation`` names an attention transformers knows (or a hub kernel,
    ``owner/repo``); otherwise a ``ValueError`` with the allowed names."""
    known = ["eager", *AttentionInterface._global_mapping]
    if isinstance(name, str) and (name in known or "/" in name):
        return
    raise ValueError(f"model.attn_implementation={name!r} is not an attention transformers knows: allowed {known}")


def configured(model_cfg) -> str:
    """The checked ``model.attn_implementation`` of a config's ``model`` group (default ``sdpa_gqa``:
    configs from before the key existed)."""
    name = model_cfg.get("attn_implementation", NAME)
    check_attn_implementation(name)
    return name
