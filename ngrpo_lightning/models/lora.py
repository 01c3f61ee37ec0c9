"""Low-rank adapters (peft's LoRA) on the policy: the base weights frozen, the adapters trained.

With ``model.lora.enabled=true`` the policy is wrapped by :func:`peft.get_peft_model`: adapted layers compute
``W x + (alpha / rank) * B A x`` with ``W`` frozen (``B`` starts at zero, so step 0's policy is the base model);
gradients and AdamW's moments exist for the adapters only. The KL reference is the policy with its adapters off
(:func:`adapters_off`), so a LoRA run loads one model. ``model.lora``: ``enabled``, ``rank`` (> 0), ``alpha`` (> 0),
``dropout`` (in [0, 1)), ``target_modules`` (``all-linear``: every linear layer but the LM head; or names like
``[q_proj, v_proj]``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ngrpo_lightning.checks import check_bool, check_number
from ngrpo_lightning.compat.peft import set_adapters_disabled
from ngrpo_lightning.models.walks import modules_of

ALL_LINEAR = "all-linear"


@dataclass
class LoraSettings:
    """``model.lora``, checked (see the module's docstring)."""

    enabled: bool = False
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | list[str] = ALL_LINEAR

    def __post_init__(self):
        check_bool("model.lora.enabled", self.enabled)
        check_number("model.lora.rank", self.rank, 1, integer=True)
        check_number("model.lora.alpha", self.alpha, 0.0, low_open=True)
        check_number("model.lora.dropout", self.dropout, 0.0, 1.0, high_open=True)
        if isinstance(self.target_modules, str):
            if self.target_modules != ALL_LINEAR:
                self.target_modules = [self.target_modules]
        else:
            self.target_modules = [str(name) for name in self.target_modules]
            if not self.target_modules:
                raise ValueError("model.lora.target_modules is empty: name modules, or use all-linear")

    @classmethod
    def from_config(cls, node) -> LoraSettings:
        """From ``cfg.model.lora`` (a mapping, or ``None`` for off)."""
        if node is None:
            return cls()
        values = dict(node)
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"model.lora has unknown keys {unknown}: allowed {sorted(cls.__dataclass_fields__)}")
        return cls(**values)


def linear_names(model: torch.nn.Module) -> list[str]:
    """The names of the model's linear layers peft can adapt (the LM head excluded, as ``all-linear``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {
        path.rsplit(".", 1)[-1]
        for path, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    }
    return sorted(names)


def check_targets(model: torch.nn.Module, settings: LoraSettings) -> None:
    """Refuse target modules the model does not have, listing those it has."""
    names = linear_names(model)
    if not names:
        raise ValueError(
            f"model.lora: {type(model).__name__} has no linear layers peft can adapt (the LM head is left out)"
        )
    if settings.target_modules == ALL_LINEAR:
        return
    unknown = [name for name in settings.target_modules if name not in names]
    if unknown:
        raise ValueError(
            f"model.lora.target_modules: {unknown} are not linear layers of {type(model).__name__}; "
            f"its linear layers are {names} (or use all-linear)"
        )


def apply(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """``model`` wrapped with fresh adapters (:func:`peft.get_peft_model`): only they train."""
    from peft import LoraConfig, get_peft_model

    check_targets(model, settings)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (its adapters can be switched off)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """Within the block ``model`` computes as its base model: each adapter layer's ``disable_adapters`` flag set as
    peft's ``disable_adapter()`` sets it, restored after, without peft's walk setting ``requires_grad`` (meant for
    no-grad passes). A model with other trainable wrappers (``modules_to_save``) takes peft's context."""
    from peft.tuners.tuners_utils import AuxiliaryTrainingWrapper, BaseTunerLayer

    modules = modules_of(model)
    if any(isinstance(m, AuxiliaryTrainingWrapper) for m in modules):
        with model.disable_adapter():
            yield
        return
    layers = [m for m in modules if isinstance(m, BaseTunerLayer)]
    were = [layer.disable_adapters for layer in layers]
    try:
        for layer in layers:
            set_adapters_disabled(layer, True)
        yield
    finally:
        for layer, was in zip(layers, were):
            set_adapters_disabled(layer, was)


def is_adapter_weight(name: str) -> bool:
    """Whether a parameter name of a peft model is an adapter's (``lora_A``, ``lora_B``, ...)."""
    return ".lora_" in name or name.startswith("lora_")


def merged_named_tensors(model: torch.nn.Module, merge: bool = True):
    """``(name, tensor)`` of the base model's state under its own names, each adapted weight merged
    (``W + (alpha / rank) B A``) into a new tensor, as an engine loading a plain model (vLLM) needs. The model is not
    changed; under FSDP2 every tensor is gathered whole (a collective). ``merge=False``: base weights, no adapters."""
    from peft.tuners.lora import LoraLayer
    from torch.distributed.tensor import DTensor

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    base = model.get_base_model()
    adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for name, tensor in base.state_dict().items():
        if is_adapter_weight(name):
            continue
        owner, sep, rest = name.partition(".base_layer.")
        tensor = whole(tensor)
        if sep:
            layer = adapted.get(owner)
            if merge and rest == "weight" and layer is not None:
                tensor = add_adapter_deltas(layer, tensor.detach().clone())
            name = f"{owner}.{rest}"
        yield name, tensor


def add_adapter_deltas(layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (a copy of ``layer``'s base weight, written in place) plus each active adapter's ``scale B A``,
    unless the adapters are off or already merged."""
    from torch.distributed.tensor import DTensor

    if layer.disable_adapters or layer.merged:
        return weight
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            delta = layer.get_delta_weight(adapter)
            weight += (delta.full_tensor() if isinstance(delta, DTensor) else delta).to(weight.dtype)
    return weight
