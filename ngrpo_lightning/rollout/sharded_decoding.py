"""Decoding an FSDP2-sharded policy, two ways (:meth:`~ngrpo_lightning.backends.base.Backend.decodes_sharded_on_copy`).

- **Through the policy, unsharded** (:func:`unsharded`): each sharded module gathers its weights once per rollout and
  the policy decodes eagerly (FSDP2's hooks cannot be recorded in a CUDA graph); full weights held during rollouts.
- **On a copy** (:class:`DecodeCopy`): a plain model of the policy's architecture on the device, into which each
  rollout writes the current weights (LoRA's merged), one sharded module at a time. It decodes as on one GPU, graphs
  included (weights rewritten in place); a rollout at the version it holds gathers nothing. Full weights held always.

Either way the rollout is the same (``tests/test_sharded_decoding.py``).
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch
from torch.distributed.tensor import DTensor

from ngrpo_lightning.backends.lora import LeanLoraLinear
from ngrpo_lightning.compat.torch import CHECKPOINT_WRAPPED
from ngrpo_lightning.compat.transformers import model_from_config
from ngrpo_lightning.models.lora import add_adapter_deltas, has_adapters, is_adapter_weight
from ngrpo_lightning.models.walks import modules_of

log = logging.getLogger(__name__)

_WRAPPED = "." + CHECKPOINT_WRAPPED  # activation checkpointing's wrapper, not in the copy's names


@contextlib.contextmanager
def unsharded(modules: list):
    """Within the block the FSDP2 ``modules`` (the root first) hold their full weights, gathered once, not once per
    decoding step. A collective: every rank enters as often; the decoding inside has none."""
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
    for m in modules:
        m.unshard()
    try:
        with torch.no_grad():  # not inference_mode: FSDP2's unsharded parameters are autograd-visible
            yield
    finally:
        for m in modules:
            m.reshard()
            # the root keeps its weights after a forward (FSDP2's default), the layers do not
            m.set_reshard_after_forward(m is not modules[0], recurse=False)


class DecodeCopy:
    """A sharded ``policy``'s weights in a plain model for decoding, built at the first :meth:`refresh` that
    ``backend`` accepts and prepared by it; one per policy and backend in a process (:meth:`of`)."""

    _kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # policy -> {id(backend): copy}

    @classmethod
    def of(cls, policy: torch.nn.Module, backend) -> DecodeCopy:
        """The copy of ``policy`` for ``backend``, made at the first call and shared by a second engine on it."""
        copies = cls._kept.setdefault(policy, {})
        kept = copies.get(id(backend))
        if kept is None or kept.backend is not backend:
            kept = copies[id(backend)] = cls(policy, backend)
        return kept

    def __init__(self, policy: torch.nn.Module, backend):
        self._policy, self.backend = weakref.ref(policy), backend  # weakly: the policy keys the kept copies
        self.model: torch.nn.Module | None = None
        self.refused = False  # the backend said no: decode through the policy (:func:`unsharded`)
        self._targets: list[tuple] = []
        self._by_module: list[list[tuple]] | None = None  # the targets by the module that gathers them
        self._modules_key: list[int] = []  # the modules they were grouped by
        self.version: int | None = None  # the policy version the copy holds (None: not known)

    def refresh(self, modules: list, version: int | None = None) -> torch.nn.Module | None:
        """The copy holding the policy's current weights, or ``None`` where the backend refuses it. Gathers ``modules``
        (FSDP2's, the root first) one at a time, a collective; nothing where ``version`` is the one the copy holds."""
        if self.refused:
            return None
        if version is not None and version == self.version and self.model is not None:
            return self.model
        self.version = None  # until every module is written
        with torch.no_grad():
            for i, m in enumerate(modules):
                m.unshard()
                try:
                    if self.model is None:
                        # normal tensors even under inference mode: the backend may time products, backward too
                        with torch.inference_mode(False), torch.enable_grad():
                            if not self._build(m):
                                return None
                    for target in self._groups(modules)[i]:
                        if not _fill(*target):
                            raise RuntimeError(f"{type(target[0]).__name__}.{target[1]} stayed sharded: not {m}'s")
                finally:
                    m.reshard()
        self.version = version
        return self.model

    def _groups(self, modules: list) -> list[list[tuple]]:
        """The targets by the FSDP2 module whose gathering makes them whole (the innermost holding their source)."""
        key = [id(m) for m in modules]
        if self._by_module is None or key != self._modules_key:
            self._modules_key = key
            owner = {}
            for i, m in enumerate(modules):  # the root first
                owner.update((id(sub), i) for sub in modules_of(m))
            self._by_module = [[] for _ in modules]
            for target in self._targets:
                if id(target[0]) not in owner:
                    raise RuntimeError(
                        f"no FSDP2 module the engine was given holds {type(target[0]).__name__}.{target[1]}: "
                        "build the engine with the run's sharded_root (RunContext.sharded_root)"
                    )
                self._by_module[owner[id(target[0])]].append(target)
        return self._by_module

    def _build(self, root: torch.nn.Module) -> bool:
        """Build the copy like ``root``'s gathered weights (dtype, device) if the backend accepts its size."""
        gathered = next(p for p in root.parameters() if not isinstance(p, DTensor))
        policy = self._policy()
        base = policy.get_base_model() if has_adapters(policy) else policy
        numel = sum(p.numel() for name, p in base.named_parameters() if not is_adapter_weight(name))
        size = numel * gathered.element_size()
        if not self.backend.decodes_sharded_on_copy(size, gathered.device):
            self.refused = True
            log.info("decoding through the FSDP2 policy unsharded, eagerly (a copy: %.2f GiB)", size / 2**30)
            return False
        model = plain_model(base, gathered.dtype, gathered.device)
        try:
            targets = list(_targets(base, model))
        except KeyError as err:  # a module the plain architecture lacks (a wrapper, an adapter kind)
            self.refused = True
            log.warning("decoding through the FSDP2 policy, eagerly: no plain copy holds its module %s", err)
            return False
        self._targets, written = [], set()
        for source, what, into in targets:  # a tied weight (an LM head that is the embedding) is written once
            if id(into) not in written:
                written.add(id(into))
                self._targets.append((source, what, into))
        self.backend.prepare(model)  # swaps classes in place: the targets' tensors stay the copy's
        self.model = self.backend.on_device(model)
        log.info("decoding on a copy of the FSDP2 policy's gathered weights (%.2f GiB), as on one device", size / 2**30)
        return True


def compute_dtype_and_device(root: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype FSDP2 gathers ``root``'s weights to compute in, and their device (a collective)."""
    root.unshard()
    try:
        gathered = next(p for p in root.parameters() if not isinstance(p, DTensor))
        return gathered.dtype, gathered.device
    finally:
        root.reshard()


def plain_model(base: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """An empty, frozen, eval-mode model of ``base``'s architecture (no adapters; its buffers) on ``device``."""
    with torch.device("meta"):
        model = model_from_config(type(base), base.config, dtype)
    model.to_empty(device=device).requires_grad_(False).eval()
    model.tie_weights()  # to_empty gives tied weights (an LM head that is the embedding) a tensor each
    with torch.no_grad():
        buffers = dict(model.named_buffers())
        for name, buffer in base.named_buffers():
            buffers[plain_name(name)].copy_(buffer)
    return model


def plain_name(name: str) -> str:
    """A sharded policy's tensor name as a plain model names it (no activation checkpointing wrapper)."""
    return name.replace(_WRAPPED, "")


def _targets(base: torch.nn.Module, copy: torch.nn.Module):
    """``(source module, what, copy's tensor)`` for every tensor the copy takes from ``base`` (``what``: a
    parameter's name, or ``None`` for a LoRA layer's merged weight). ``KeyError``: a module with no place in it."""
    from peft.tuners.lora import LoraLayer

    copies = dict(copy.named_modules())
    stack = [("", base)]
    while stack:
        name, module = stack.pop()
        into = copies[plain_name(name)]
        if isinstance(module, LoraLayer):  # its base layer and adapters make one weight
            yield module, None, into.weight
            if module.base_layer.bias is not None:
                yield module.base_layer, "bias", into.bias
            continue
        params = dict(into.named_parameters(recurse=False, remove_duplicate=False))
        for key, _ in module.named_parameters(recurse=False, remove_duplicate=False):
            yield module, key, params[key]
        # (an empty container, a peft ModuleDict of no adapter, has nothing to copy)
        stack.extend((f"{name}.{key}" if name else key, child) for key, child in module.named_children() if child)


def _fill(source: torch.nn.Module, what: str | None, into: torch.Tensor) -> bool:
    """Write ``source``'s tensor into ``into``; ``False`` while it is still sharded."""
    if what is not None:
        value = source.get_parameter(what)
        if isinstance(value, DTensor):
            return False
        into.copy_(value)
        return True
    weight = source.base_layer.weight
    if isinstance(weight, DTensor):
        return False
    adapter = source.merge_adapter_name() if isinstance(source, LeanLoraLinear) else None
    if adapter is not None:  # as one-device decoding merges it
        source.merged_weight(adapter, out=into)
    else:  # peft's own delta where the lean layer does not merge (variants, several adapters)
        add_adapter_deltas(source, into.copy_(weight))
    return True
