"""Walking a model's modules at every rollout and pass, cheaply.

A peft model has thousands of modules, walked at every rollout or pass, and a small model's GPU step waits on its
host. ``model.modules()`` resumes a generator per nesting level per module and ``model.train()`` goes through
``Module.__setattr__`` and a ``children()`` generator for each; these give the same results from one loop."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ngrpo_lightning.compat.torch import child_modules


def modules_of(model: torch.nn.Module, prune=None) -> list[torch.nn.Module]:
    """``list(model.modules())``: each module once, in the same order. ``prune(module)``, if given, returns the
    children not to walk into (or ``None``)."""
    out, seen, stack = [], set(), [model]
    while stack:
        module = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        out.append(module)
        children = child_modules(module).values()
        pruned = None if prune is None else prune(module)
        if pruned:
            left_out = {id(child) for child in pruned}
            children = [child for child in children if id(child) not in left_out]
        stack.extend(reversed(children))
    return out


def _train_is_the_flag(module: torch.nn.Module) -> bool:
    """Whether ``module.train(mode)`` only sets the ``training`` flags: ``torch.nn.Module``'s own, or
    ``PreTrainedModel``'s without hub kernels."""
    train = type(module).train
    if train is torch.nn.Module.train:
        return True
    return train is PreTrainedModel.train and not getattr(module, "use_kernels", False)


def set_training(model: torch.nn.Module, mode: bool) -> None:
    """``model.train(mode)``: the flag written on each module directly where every module's ``train`` only sets flags
    (:func:`_train_is_the_flag`), else ``model.train(mode)`` itself."""
    modules = modules_of(model)
    if not all(_train_is_the_flag(m) for m in modules):
        model.train(mode)
        return
    for module in modules:
        module.__dict__["training"] = mode
