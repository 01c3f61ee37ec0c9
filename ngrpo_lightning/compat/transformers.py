"""transformers internals the package reads, tested on transformers 5.19 and 5.23-5.25.

- a config's attention implementation (``config._attn_implementation``: transformers has a setter, no getter);
- its Llama-style attention's forward between the rotary embedding and the output projection (:func:`llama_attention`),
  which the fused attention (``backends/fused.py``) runs after its own rotation;
- a model built from a config without loading weights (``PreTrainedModel._from_config``) and a model's tied weights'
  names (``_tied_weights_keys``).
"""

from __future__ import annotations

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ngrpo_lightning.compat import Library

TESTED = {"transformers": ">=5.19,<5.26"}
TRANSFORMERS = Library("transformers", TESTED)
TRANSFORMERS.warn_if_untested()

__all__ = [
    "TESTED",
    "attention_function",
    "kv_cache_argument",
    "attn_implementation",
    "llama_attention",
    "model_from_config",
    "tied_weight_names",
]


def attn_implementation(config) -> str | None:
    """The attention implementation a model of ``config`` runs (``"sdpa"``, ``"eager"``, a registered name)."""
    return TRANSFORMERS.attribute(config, "_attn_implementation")


def attention_function(config):
    """transformers' attention function for ``config``'s implementation, or ``None`` (``eager``: the class's own)."""
    return ALL_ATTENTION_FUNCTIONS.get(attn_implementation(config))


def kv_cache_argument(past_key_values, kwargs: dict):
    """The KV cache an attention's forward was given: ``past_key_values`` up to transformers 5.23, ``cache=`` from
    5.24 (the old name deprecated until 5.40), taken out of ``kwargs``."""
    cache = kwargs.pop("cache", None)
    return past_key_values if past_key_values is not None else cache


def llama_attention(module, attend, query, key, value, attention_mask, past_key_values, **kwargs):
    """``LlamaAttention.forward`` (Llama, Qwen2, Mistral) from the rotated ``query`` and ``key`` [N, H or H_kv, L, d]
    and ``value`` on: the cache's update, ``attend`` (:func:`attention_function`), the heads merged. Returns
    ``(out [N, L, H d], weights)``, before the output projection."""
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, module.layer_idx)
    if hasattr(module, "sliding_window"):  # Qwen2's and Mistral's attentions pass it on
        kwargs["sliding_window"] = module.sliding_window
    out, weights = attend(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=module.scaling,
        **kwargs,
    )
    return out.reshape(*out.shape[:2], -1).contiguous(), weights


def model_from_config(cls: type, config, dtype: torch.dtype) -> torch.nn.Module:
    """A model of class ``cls`` made from ``config`` in ``dtype``, its weights initialised, not loaded."""
    return TRANSFORMERS.attribute(cls, "_from_config")(config, dtype=dtype)


def tied_weight_names(model: torch.nn.Module) -> set[str]:
    """The names of the weights ``model``'s class ties to others (the LM head to the embedding), whether or not its
    config ties them: a checkpoint may leave them out."""
    return set(getattr(model, "_tied_weights_keys", None) or [])
