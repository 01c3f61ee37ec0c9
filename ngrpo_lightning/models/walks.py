"""Walking a model's modules at every rollout and pass, cheaply.

A GPU step of a small model waits on its host, and a peft model has thousands of modules (2,499
at the packaged model's shape, against 397 without adapters): a walk over them made at every
rollout or pass is paid thousands of times per walk. ``model.modules()`` resumes a generator per
level of nesting for each module (eight deep in a peft model), and ``model.train()`` goes through
``Module.__setattr__`` and a ``children()`` generator for each. These give the same results from
one loop (``benchmarks/host_overhead.py`` times both)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def modules_of(model: torch.nn.Module, prune=None) -> list[torch.nn.Module]:
    """``list(model.modules())``: each module once, in the same order. ``prune(module)``, if given,
    is called on each module as it is reached and returns the children not to walk into (or
    ``None``): a caller that acts on modules leaves out what a module's own action covers."""
    out, seen, stack = [], set(), [model]
    while stack:
        module = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        out.append(module)
        children = module._modules.values()
        pruned = None if prune is None else prune(module)
        if pruned:
            left_out = {id(child) for child in pruned}
            children = [child for child in children if id(child) not in left_out]
        stack.extend(reversed(children))
    return out


def _train_is_the_flag(module: torch.nn.Module) -> bool:
    """Whether ``module.train(mode)`` does no more than set its ``training`` flag and its children's:
    ``torch.nn.Module``'s own, or transformers' ``PreTrainedModel``'s when no hub kernels are in use
    (it re-casts them, with ``use_kernels``). A class with a ``train`` of its own (peft's DoRA layers
    clear a cache) is not."""
    train = type(module).train
    if train is torch.nn.Module.train:
        return True
    return train is PreTrainedModel.train and not getattr(module, "use_kernels", False)


def set_training(model: torch.nn.Module, mode: bool) -> None:
    """``model.train(mode)``: the flag written on each module directly where every module's
    ``train`` only sets flags (:func:`_train_is_the_flag`), else ``model.train(mode)`` itself."""
    modules = modules_of(model)
    if not all(_train_is_the_flag(m) for m in modules):
        model.train(mode)
        return
    for module in modules:
        module.__dict__["training"] = mode
