"""peft internals the package reads and writes, tested on peft 0.21.2.

A LoRA layer's adapter weights are read from its module and parameter dictionaries (:func:`adapter_parts`), fewer
Python calls than ``Module.__getattr__`` and peft's properties. Adapters are switched off and on for the reference's
passes by the flag ``disable_adapters`` reads (:func:`set_adapters_disabled`): peft's own switch also walks every
adapter weight's ``requires_grad``, costing more than a no-grad pass and turning on gradients a user froze.
"""

from __future__ import annotations

from ngrpo_lightning.compat import Library

TESTED = {"peft": ">=0.21.2,<0.22"}
PEFT = Library("peft", TESTED)
PEFT.warn_if_untested()

__all__ = ["TESTED", "adapter_parts", "set_adapters_disabled"]


def adapter_parts(layer, name: str) -> tuple | None:
    """``(A, B, dropout)`` of the adapter ``name`` of the peft LoRA ``layer`` (its weights and dropout module);
    ``None`` where the layer has no such adapter."""
    try:
        children = layer._modules
        down = children["lora_A"]._modules.get(name)
        if down is None:
            return None
        up = children["lora_B"]._modules[name]
        return down._parameters["weight"], up._parameters["weight"], children["lora_dropout"]._modules[name]
    except (AttributeError, KeyError) as err:
        raise PEFT.error(f"{type(layer).__name__}'s lora_A, lora_B and lora_dropout modules of {name!r}") from err


def set_adapters_disabled(layer, disabled: bool) -> None:
    """Switch ``layer``'s adapters off (``disabled``) or on, ``requires_grad`` left as it is."""
    if not hasattr(layer, "_disable_adapters"):  # an attribute written where it is not would do nothing
        raise PEFT.error(f"{type(layer).__name__}._disable_adapters")
    layer._disable_adapters = disabled
