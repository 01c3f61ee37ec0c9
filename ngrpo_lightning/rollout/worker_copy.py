"""The rollouts-ahead worker's copy of the policy, and the weights each job hands it.

The worker (:mod:`.ahead`) decodes while the trainer changes the policy, so it decodes a copy,
and every job carries the weights of the policy version it was queued at (a *snapshot*, taken
on the training thread), which the worker writes into its copy before rolling out. Two kinds:

- :class:`ModuleCopy`, for a policy in one process: a deep copy sharing what training never
  changes (a LoRA policy's base weights, buffers); a snapshot is the trainable parameters only.
- :class:`GatheredCopy`, for a policy FSDP2 shards over several processes: a plain model of its
  architecture holding the full weights on this rank (the worker cannot decode through the
  sharded policy: every forward there is a collective, which the training thread runs too); a
  snapshot is the full weights, gathered (a collective: every rank queues the same jobs at the
  same step, so every rank gathers together), a LoRA layer's merged (``W + scale B A``).
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

from ngrpo_lightning.models.lora import has_adapters
from ngrpo_lightning.rollout.engine import full_named_tensors
from ngrpo_lightning.rollout.sharded_decoding import plain_model, plain_name

__all__ = ["GatheredCopy", "ModuleCopy", "trainable_snapshot", "worker_copy"]


def trainable_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s trainable parameters by name: what an optimizer step changes (the
    frozen weights of a LoRA policy are shared with the worker's copy, never copied again)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


class ModuleCopy:
    """A deep copy of a policy in one process; snapshots are its trainable parameters."""

    def __init__(self, policy: torch.nn.Module):
        frozen = [p for p in policy.parameters() if not p.requires_grad] + list(policy.buffers())
        self.model = copy.deepcopy(policy, memo={id(t): t for t in frozen})
        self.model.requires_grad_(False)
        self._params = dict(self.model.named_parameters())

    @staticmethod
    def snapshot(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        return trainable_snapshot(policy)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in weights.items():
                self._params[name].copy_(tensor)


class GatheredCopy:
    """A plain model of a sharded policy's architecture, on this rank's device in the policy's
    dtype, prepared by the run's ``backend`` as an unsharded policy is; snapshots are the full,
    gathered weights under the plain model's names."""

    def __init__(self, policy: torch.nn.Module, backend):
        base = policy.get_base_model() if has_adapters(policy) else policy
        param = next(base.parameters())
        local = param.to_local() if isinstance(param, DTensor) else param
        model = plain_model(base, local.dtype, local.device)
        # the tensors written by name, taken before the backend swaps module classes (in place: they stay)
        self._tensors = dict(model.state_dict(keep_vars=True))
        self.written = False
        backend.prepare(model)
        self.model = backend.on_device(model)

    @staticmethod
    def snapshot(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        live, out = _live(policy), {}
        for name, tensor in full_named_tensors(policy):  # gathered: new tensors, merged ones too
            out[plain_name(name)] = tensor.detach().clone() if tensor.data_ptr() in live else tensor.detach()
        return out

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(weights) - set(self._tensors))
        if unknown:
            raise RuntimeError(f"the worker's plain copy of the policy has no tensor {unknown[0]!r}")
        missing = sorted(set(self._tensors) - set(weights))
        if missing and not self.written:
            raise RuntimeError(f"the sharded policy's gathered weights lack {missing[0]!r} of its plain copy")
        with torch.no_grad():
            for name, tensor in weights.items():
                self._tensors[name].copy_(tensor)
        self.written = True


def _live(policy: torch.nn.Module) -> set[int]:
    """Storage addresses of the policy's own tensors that are whole on this rank (a gathered tensor
    is new; one the policy holds whole is copied, since the optimizer changes it in place)."""
    return {t.data_ptr() for t in [*policy.parameters(), *policy.buffers()] if not isinstance(t, DTensor)}


def worker_copy(policy: torch.nn.Module, backend, sharded: bool) -> ModuleCopy | GatheredCopy:
    """The worker's copy: gathered into a plain model where FSDP2 shards the policy, else a deep copy."""
    return GatheredCopy(policy, backend) if sharded else ModuleCopy(policy)
