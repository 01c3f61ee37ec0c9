"""Swapping a module's class once, explicitly: how a backend changes what a module computes.

A backend never reassigns ``forward``: it swaps the module's class for a subclass (the idiom of
``torch.nn.utils.parametrize`` and FSDP2's ``fully_shard``). Parameters, buffers, hooks and names stay, so state
dicts, optimizers, peft and FSDP2 see the same module; each swapped class carries ``why`` for :func:`describe`.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def swapped_class(mixin: type, cls: type) -> type:
    """The subclass of ``cls`` that computes as ``mixin`` says (made once per pair)."""
    if issubclass(cls, mixin):
        return cls
    return type(f"{mixin.prefix}{cls.__name__}", (mixin, cls), {"__module__": mixin.__module__})


def swap(module: torch.nn.Module, mixin: type, **attributes) -> torch.nn.Module:
    """Give ``module`` the class ``mixin`` + its own class, and ``attributes``; returns it."""
    module.__class__ = swapped_class(mixin, type(module))
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def forwards_agree(module: torch.nn.Module, mixin: type, *args, agree=torch.equal, **kwargs) -> bool:
    """Whether ``mixin``'s forward gives ``module``'s own output (the first of a tuple) on ``args``, as
    ``agree(own, new)`` judges, in eval mode without gradients. ``False`` where either forward raises."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            own, new = type(module).forward(module, *args, **kwargs), mixin.forward(module, *args, **kwargs)
    except Exception:
        return False
    finally:
        module.train(was_training)
    own, new = (out[0] if isinstance(out, tuple) else out for out in (own, new))
    return own.shape == new.shape and own.dtype == new.dtype and bool(agree(own, new))


def swap_checked(model: torch.nn.Module, candidate, over_swapped: bool = False) -> int:
    """Swap each module that ``candidate(module)`` gives ``(mixin, check)`` for, where ``check(module)`` holds
    (checked once per class), skipping swapped modules unless ``over_swapped``. Returns how many were swapped."""
    checked: dict[tuple[type, type], bool] = {}
    count = 0
    for module in model.modules():
        swapped = not over_swapped and getattr(type(module), "prefix", None) is not None
        found = None if swapped else candidate(module)
        if found is None:
            continue
        mixin, check = found
        key = (type(module), mixin)
        if key not in checked:
            checked[key] = check(module)
        if checked[key]:
            swap(module, mixin)
            count += 1
    return count


def original_class(module: torch.nn.Module) -> type:
    """The class ``module`` had before any swap (for messages and describe)."""
    return _original(type(module))


@functools.cache
def _original(cls: type) -> type:
    while getattr(cls, "prefix", None) is not None and len(cls.__bases__) == 2:
        cls = cls.__bases__[1]
    return cls


def describe(
    model: torch.nn.Module, backend=None, kinds: tuple[type, ...] = (torch.nn.Linear,)
) -> list[tuple[str, str, str]]:
    """``(name, class, why)`` for every module of ``model`` that is one of ``kinds`` (default: linear layers). Given
    the ``backend`` that prepared it, first ``(speed-up, "on" or "off", why)`` for each of its speed-ups."""
    rows = [(name, "on" if on else "off", why) for name, on, why in backend.speedup_reasons()] if backend else []
    for name, module in model.named_modules():
        if isinstance(module, kinds):
            why = getattr(module, "why", None) or "no backend has prepared this model"  # a swapped class says it
            rows.append((name, type(module).__name__, why))
    return rows
