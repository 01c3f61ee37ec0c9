"""The rollouts-ahead worker's copy of the policy, and the weights each job hands it.

The worker (:mod:`.ahead`) decodes a copy while the trainer changes the policy; every job carries the weights of the
version it was queued at (a *snapshot*, taken on the training thread):

- :class:`ModuleCopy`, one process: a deep copy sharing what training never changes (a LoRA policy's base weights,
  buffers); a snapshot is the trainable parameters.
- :class:`GatheredCopy`, FSDP2: a plain model of the full weights on this rank in FSDP2's compute dtype (a sharded
  forward is a collective); a snapshot is the full weights, gathered (every rank queues the same jobs together).
- :class:`GatheredLoraCopy`, sharded LoRA: the plain model of its base, gathered once, with adapters of its own; a
  snapshot is the adapters, gathered.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

from ngrpo_lightning.models.lora import has_adapters, is_adapter_weight, merged_named_tensors
from ngrpo_lightning.rollout.sharded_decoding import compute_dtype_and_device, plain_model, plain_name

__all__ = ["GatheredCopy", "GatheredLoraCopy", "ModuleCopy", "trainable_snapshot", "worker_copy"]


def trainable_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s trainable parameters by name: what an optimizer step changes."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


class ModuleCopy:
    """A deep copy of a policy in one process; snapshots are its trainable parameters."""

    def __init__(self, policy: torch.nn.Module):
        frozen = [p for p in policy.parameters() if not p.requires_grad] + list(policy.buffers())
        self.model = copy.deepcopy(policy, memo={id(t): t for t in frozen})
        self.model.requires_grad_(False)
        self._tensors = dict(self.model.named_parameters())

    def snapshot(self, policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        return trainable_snapshot(policy)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in weights.items():
                self._tensors[name].copy_(tensor)


class GatheredCopy:
    """A plain model of a sharded policy's architecture, on this rank's device in FSDP2's compute dtype, prepared by
    the run's ``backend``; snapshots are the full, gathered weights under the plain model's names."""

    def __init__(self, policy: torch.nn.Module, root: torch.nn.Module, backend):
        self.dtype, device = compute_dtype_and_device(root)
        # the tensors written by name, taken before the backend swaps module classes (in place: they stay)
        model, self._tensors = self._plain(policy, device)
        self._complete = False  # the first job writes every tensor
        backend.prepare(model)
        self.model = backend.on_device(model)

    def _plain(self, policy: torch.nn.Module, device: torch.device) -> tuple[torch.nn.Module, dict]:
        """The plain model, and the tensors a job writes in it by name."""
        model = plain_model(policy, self.dtype, device)
        return model, dict(model.state_dict(keep_vars=True))

    def snapshot(self, policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        return _whole(policy.state_dict().items(), self.dtype)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(weights) - set(self._tensors))
        if unknown:
            raise RuntimeError(f"the worker's plain copy of the policy has no tensor {unknown[0]!r}")
        missing = sorted(set(self._tensors) - set(weights))
        if missing and not self._complete:
            raise RuntimeError(f"the sharded policy's gathered weights lack {missing[0]!r} of its plain copy")
        with torch.no_grad():
            for name, tensor in weights.items():
                self._tensors[name].copy_(tensor)
        self._complete = True


class GatheredLoraCopy(GatheredCopy):
    """A sharded LoRA policy's base, gathered once into a plain model, with adapters of the policy's configuration;
    snapshots are the adapters alone, gathered."""

    def _plain(self, policy: torch.nn.Module, device: torch.device) -> tuple[torch.nn.Module, dict]:
        from peft import get_peft_model

        model = plain_model(policy.get_base_model(), self.dtype, device)
        tensors = model.state_dict(keep_vars=True)
        with torch.no_grad():  # gathered one at a time (each whole already), written (cast) in place
            for name, tensor in merged_named_tensors(policy, merge=False):
                tensors[plain_name(name)].copy_(tensor)
        model = get_peft_model(model, copy.deepcopy(policy.peft_config[policy.active_adapter]))
        model.requires_grad_(False).eval()  # the adapters' dropout too
        return model, {plain_name(n): p for n, p in model.named_parameters() if is_adapter_weight(n)}

    def snapshot(self, policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        return _whole(((n, p) for n, p in policy.named_parameters() if p.requires_grad), None)


def _whole(named_tensors, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``named_tensors`` whole on this rank, by the plain model's names, in ``dtype`` (None: as they are), each a
    tensor of its own (gathered, or copied)."""
    out = {}
    for name, tensor in named_tensors:
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()
        out[plain_name(name)] = whole.detach() if dtype is None else whole.detach().to(dtype)
    return out


def worker_copy(policy: torch.nn.Module, backend, root: torch.nn.Module | None = None):
    """The worker's copy of ``policy``: a deep copy, or, where FSDP2 shards it (``root``: its root module), a plain
    model of its gathered weights (LoRA: its base)."""
    if root is None:
        return ModuleCopy(policy)
    return GatheredLoraCopy(policy, root, backend) if has_adapters(policy) else GatheredCopy(policy, root, backend)
