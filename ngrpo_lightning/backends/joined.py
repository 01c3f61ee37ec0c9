"""Projections that read the same input, multiplied as one product inside a rollout.

An attention's q, k, v projections read the same activations, and so do a gated MLP's gate and up. Inside a rollout
(:func:`~.passes.packed_for_pass` decoding) a :class:`JoinedProjections` module multiplies its input once by their
weights stacked by rows: the same dot products, one kernel where there were two or three. The stacked weights are:

- **row blocks of one tensor already** (:func:`join_weights`, each parameter a view of its rows): read in place;
- **LoRA layers**: each writes its merged copy ``W + scale B A`` into its rows of one copy (:mod:`.lora`);
- **other plain weights**: copied into one where the module accepts the memory (``copies_plain``); otherwise the
  projections run as defined. With ``keep`` (graph replays) a copy keeps its storage, rewritten in place.
"""

from __future__ import annotations

import abc

import torch

from ngrpo_lightning.backends.joint_products import TrainingJoin, rows_of_one_tensor
from ngrpo_lightning.backends.linear import plain_linear
from ngrpo_lightning.backends.lora import LeanLoraLinear
from ngrpo_lightning.compat.torch import has_forward_hooks, mark_static_address


def _product_weight(projection: torch.nn.Module) -> torch.nn.Linear | None:
    """The linear layer whose (LoRA: merged) weight is all ``projection`` multiplies by in a rollout, or ``None``."""
    if isinstance(projection, LeanLoraLinear):
        return projection.base_layer if projection.can_merge() and not has_forward_hooks(projection) else None
    return projection if plain_linear(projection, every_pass=True) else None


def _bases(projections: tuple[torch.nn.Module, ...]) -> list[torch.nn.Module]:
    """The layers whose weights a group's one product reads: a LoRA layer's base layer, else itself."""
    return [p.base_layer if isinstance(p, LeanLoraLinear) else p for p in projections]


def join_weights(projections: tuple[torch.nn.Module, ...]) -> bool:
    """Re-home the weights (and biases) of plain linear ``projections`` as row blocks of one tensor, each the same
    ``Parameter`` viewing its rows (optimizers, state dicts and saving see no change); returns whether they are
    joined. For a model on its device (:meth:`~.base.Backend.on_device`)."""
    projections = _bases(projections)  # LoRA's frozen base layers, joined for the adapters' one node
    if not all(plain_linear(p, every_pass=True) for p in projections):
        return False
    weights = [p.weight for p in projections]
    biases = [p.bias for p in projections]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1 or len({b is None for b in biases}) != 1:
        return False
    if rows_of_one_tensor(weights) is not None and (biases[0] is None or rows_of_one_tensor(biases) is not None):
        return True  # joined already
    with torch.no_grad():
        for group in (weights, biases) if biases[0] is not None else (weights,):
            joint = torch.cat([t.detach() for t in group])
            for t, rows in zip(group, joint.split([t.shape[0] for t in group]), strict=True):
                t.data = rows
    return True


class JoinedProjections:
    """Mixin for a module whose :meth:`projections` read one input: one product inside a rollout (``_joint``)."""

    copies_plain = True  # plain weights not already joined are copied into one for a rollout
    joined_on_device = False  # set by the backend's join (fused.join_projections): training passes join too
    _joint: tuple | None = None  # (weight, bias, sizes) inside a rollout
    _joint_kept: tuple | None = None  # (weight, bias) storage kept across rollouts (``keep``)
    _joint_lora: tuple = ()  # the LoRA projections writing their merged copies into it, this rollout
    _joint_keeps: bool = False  # this rollout's copy is the kept one

    @abc.abstractmethod
    def projections(self) -> tuple[torch.nn.Module, ...]:
        """The layers that read the module's one input, in the order of their outputs side by side."""

    def joins_in_training(self) -> bool:
        """Whether a pass outside rollouts may multiply the projections as one product too."""
        return True

    def joint_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The projections' outputs side by side from one product, or ``None`` (run them as defined): in a rollout on
        ``_joint``, elsewhere where :class:`~.joint_products.TrainingJoin` allows."""
        if self._joint is not None:
            weight, bias, _ = self._joint
            return torch.nn.functional.linear(x, weight, bias)
        if not self.joined_on_device or not self.joins_in_training():  # e.g. sharded by FSDP2: never joined
            return None
        projections = self.projections()
        plan = self.__dict__.get("_training_join")
        if plan is None or not plan.holds(projections, x.dtype):
            plan = self.__dict__["_training_join"] = TrainingJoin(projections, x.dtype)
        return plan(x)

    def start_merged_pass(self, rows: int, keep: bool = False) -> bool:
        """Multiply by the projections' weights stacked by rows until :meth:`end_pass`; ``False`` where one is not
        a plain product or LoRA's, or the weights would need a copy the module does not accept."""
        projections = self.projections()
        bases = [_product_weight(p) for p in projections]
        if any(b is None for b in bases):
            return False
        if len({(b.weight.dtype, b.weight.device, b.weight.shape[1], b.bias is None) for b in bases}) != 1:
            return False
        sizes = [b.weight.shape[0] for b in bases]
        lora = any(isinstance(p, LeanLoraLinear) for p in projections)
        weight = None if lora else rows_of_one_tensor([b.weight for b in bases])
        has_bias = bases[0].bias is not None
        bias = rows_of_one_tensor([b.bias for b in bases]) if weight is not None and has_bias else None
        if weight is not None and (bias is not None or not has_bias):  # joined: read in place
            self._joint, self._joint_lora, self._joint_keeps = (weight, bias, sizes), (), False
            return True
        if not lora and not self.copies_plain:
            return False
        weight, bias = self._copy_storage((sum(sizes), bases[0].weight.shape[1]), bases[0].weight, has_bias, keep)
        merged = []
        with torch.no_grad():
            for projection, base, rows_of in zip(projections, bases, weight.split(sizes), strict=True):
                if isinstance(projection, LeanLoraLinear):
                    projection._kept = rows_of  # its merged copy, written in place
                    projection.start_merged_pass(rows, keep=True)
                    merged.append(projection)
                else:
                    rows_of.copy_(base.weight)
            if has_bias:
                torch.cat([b.bias.detach() for b in bases], out=bias)
        self._joint, self._joint_lora, self._joint_keeps = (weight, bias, sizes), tuple(merged), keep
        return True

    def _copy_storage(self, shape: tuple, like: torch.Tensor, has_bias: bool, keep: bool) -> tuple:
        """``(weight, bias)`` tensors for a copy: the kept ones where ``keep`` and they fit."""
        kept = self._joint_kept if keep else None
        if kept is None or kept[0].shape != shape or kept[0].dtype != like.dtype or kept[0].device != like.device:
            kept = (torch.empty(shape, dtype=like.dtype, device=like.device),)
            kept += (torch.empty(shape[0], dtype=like.dtype, device=like.device) if has_bias else None,)
            if keep:
                self._joint_kept = kept
                for t in kept:
                    if t is not None:
                        mark_static_address(t)  # a compiled step reads it in place
        return kept

    def end_pass(self) -> None:
        for projection in self._joint_lora:
            projection.end_pass()
            if not self._joint_keeps:
                projection._kept = None  # a view of this rollout's own copy: let it go with it
        self._joint, self._joint_lora = None, ()
