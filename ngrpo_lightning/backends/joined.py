"""The speed-up ``fewer_kernels_per_layer``, whole: projections that read the same input, multiplied as one product.

An attention's q, k, v projections read the same activations, and so do a gated MLP's gate and up: multiplied by
their weights stacked by rows they give the same dot products, one kernel where there were two or three.

- **In a rollout** (:func:`~.passes.packed_for_pass` decoding) a :class:`JoinedProjections` module multiplies its
  input once by the stacked weights. They are **row blocks of one tensor already** (:func:`join_weights`, each
  parameter a view of its rows): read in place; **LoRA layers**: each writes its merged copy ``W + scale B A`` into
  its rows of one copy (:mod:`.lora`); **other plain weights**: copied into one where the module accepts the memory
  (``copies_plain``), otherwise the projections run as defined. With ``keep`` (graph replays) a copy keeps its
  storage, rewritten in place.
- **In training**, where the CUDA backend joined the weights on the device (:func:`join_weights`), the policy's
  log-prob passes and update multiply each group once (:class:`JointLinear` for plain layers,
  :class:`JointLoraProduct` for LoRA on frozen base weights); each parameter still gets its own gradient. Whether a
  group can is decided once (:class:`TrainingJoin`); each pass only checks that nothing moved, a few attribute reads
  per group, since a small model's GPU update waits on its host.

The fused modules that hold these groups are :mod:`.fused`'s.
"""

from __future__ import annotations

import abc

import torch

from ngrpo_lightning.backends.lora import LeanLoraLinear, base_plus_adapter, frozen_product, product_in
from ngrpo_lightning.backends.packing import plain_linear
from ngrpo_lightning.compat.torch import has_forward_hooks, mark_static_address, tensor_version


# ---------------------------------------------------------------- training passes: one product per group
def rows_of_one_tensor(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose consecutive row blocks ``tensors`` are, in order (a view, no copy), or ``None``."""
    first = tensors[0].detach()
    if any(not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:] for t in tensors):
        return None
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for t in tensors:
        if t.device != first.device or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


class TrainingJoin:
    """What a training pass multiplies for ``projections`` on inputs of ``dtype``, decided once: ``kind`` ``"plain"``
    (:class:`JointLinear`), ``"lora"`` (:class:`JointLoraProduct`) or ``None`` (apart); :meth:`holds` says whether it
    still stands. LoRA layers are judged whatever their adapters' state, which :meth:`__call__` reads per pass."""

    def __init__(self, projections: tuple, dtype: torch.dtype):
        self.projections, self.dtype, self.kind = projections, dtype, None
        self.weight = self.bias = None
        self.adapters: list[tuple] = []
        self.params: list[torch.Tensor] = []
        self.lora = lora = all(isinstance(p, LeanLoraLinear) for p in projections)
        layers = [p.base_layer for p in projections] if lora else list(projections)
        if lora:  # the adapters whatever their state now (the reference's pass turns them off)
            self.active = [p.active_adapter for p in projections]
            parts = [p.adapter_weights(dtype) for p in projections]
            usable = all(part is not None and type(part[4]) is torch.nn.Identity for part in parts)
            if not usable or any(p.merged_adapters for p in projections):
                layers = []
            self.adapters = [part[:4] for part in parts] if layers else []  # (name, A, B, scale) per layer
        plain = layers and all((frozen_product(b) if lora else plain_linear(b, every_pass=True)) for b in layers)
        biases = [b.bias for b in layers] if plain else []
        if plain and all((b is None) == (biases[0] is None) for b in biases):
            self.weight = rows_of_one_tensor([b.weight for b in layers])
            self.bias = None if biases[0] is None else rows_of_one_tensor(biases)
            if self.weight is not None and (biases[0] is None or self.bias is not None):
                self.kind = "lora" if lora else "plain"
                self.params = [b.weight for b in layers] + ([] if biases[0] is None else biases)
        if self.kind == "lora":
            self.trained = [a[1] for a in self.adapters] + [a[2] for a in self.adapters]  # the A's, then the B's
            self.scales = [a[3] for a in self.adapters]
            self.alpha = self.scales[0] if len(set(self.scales)) == 1 else None  # one scale: the products apply it
            self.params += self.trained
        self.addresses = [t.data_ptr() for t in self.params]
        self.cast_key, self.down, self.blocks = None, None, None

    def holds(self, projections: tuple, dtype: torch.dtype) -> bool:
        """Whether the decision still stands: the same layers and dtype, no hook added, every parameter where it was,
        and (LoRA) the same active adapters, none merged (plain loops: it runs per group and pass)."""
        if dtype != self.dtype or projections != self.projections:
            return False
        for p in projections:
            if has_forward_hooks(p):
                return False
        if self.lora:
            for p, active in zip(projections, self.active):
                if p.active_adapter != active or p.merged_adapters:
                    return False
        for t, address in zip(self.params, self.addresses):
            if t.data_ptr() != address:
                return False
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The group's outputs side by side, or ``None`` (run them apart)."""
        if self.kind is None:
            return None
        if self.kind == "lora":
            return self._lora(x)
        if not torch.is_grad_enabled():
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if torch.is_autocast_enabled(x.device.type):  # the products' dtypes are autocast's: run them apart
            return None
        return JointLinear.apply(x, self.weight, self.bias, len(self.projections), *self.params)

    def _lora(self, x: torch.Tensor) -> torch.Tensor | None:
        off = [p.disable_adapters for p in self.projections]
        if all(off):  # the base model (the reference's pass): one product of the joined base weights
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if any(off) or torch.is_autocast_enabled(x.device.type):
            return None
        key = [tensor_version(a) for a in self.trained]
        if key != self.cast_key:  # the adapters changed (an optimizer step): cast and stack them again
            with torch.inference_mode(False), torch.no_grad():
                # the layers' own cast copies (adapters_in), which the rollout's merging made already
                casts = [p.adapters_in(a[0], self.dtype, a[1], a[2]) for p, a in zip(self.projections, self.adapters)]
                self.down = torch.cat([c[0] for c in casts])
                if self.alpha is not None:
                    scaled = [c[1] for c in casts]
                else:  # several scales: each B scaled in float32, rounded once
                    scaled = [(a[2].detach() * a[3]).to(self.dtype) for a in self.adapters]
                self.blocks = torch.block_diag(*scaled)
            self.cast_key = key
        alpha = 1.0 if self.alpha is None else self.alpha
        return JointLoraProduct.apply(
            x, self.weight, self.bias, self.down, self.blocks, self.scales, alpha, *self.trained
        )


class JointLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` where ``weight`` (and ``bias``) are the row blocks of the ``blocks`` layers'
    parameters given after them, each block's gradient (its rows of one product) going to its own parameter."""

    @staticmethod
    def forward(ctx, x, weight, bias, blocks, *params):
        ctx.save_for_backward(x, weight)
        ctx.sizes, ctx.has_bias = [p.shape[0] for p in params[:blocks]], bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        needs, blocks = ctx.needs_input_grad, len(ctx.sizes)
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = torch.mm(g, weight).view(x.shape) if needs[0] else None
        grad_w = [None] * blocks
        if any(needs[4 : 4 + blocks]):
            rows = torch.mm(g.t(), x.reshape(-1, x.shape[-1])).split(ctx.sizes)
            grad_w = [r if n else None for r, n in zip(rows, needs[4 : 4 + blocks], strict=True)]
        grad_b = []
        if ctx.has_bias:
            grad_b = [None] * blocks
            if any(needs[4 + blocks :]):
                sums = g.sum(0).split(ctx.sizes)
                grad_b = [b if n else None for b, n in zip(sums, needs[4 + blocks :], strict=True)]
        return (grad_x, None, None, None, *grad_w, *grad_b)


class JointLoraProduct(torch.autograd.Function):
    """The LoRA layers that read one input (q, k, v; gate, up) as one node: ``linear(x, W, b)`` on their frozen base
    weights joined by rows, plus ``d = A x`` for their A's stacked by rows, plus ``alpha`` times ``d`` by their B's in
    one block-diagonal matrix (one scale for all: the cast B's; else each block ``scale B`` and ``alpha`` 1). Backward:
    ``grad_d = alpha g B``, the input's ``g W + grad_d A``, the A's from one product, each B's from its own.
    ``params``: the A's, then the B's."""

    @staticmethod
    def forward(ctx, x, weight, bias, down, blocks, scales, alpha, *params):
        out, d = base_plus_adapter(x, weight, bias, down, blocks, alpha)
        ctx.save_for_backward(x, d, down, blocks, weight)
        count = len(params) // 2
        ctx.scales, ctx.alpha, ctx.dtypes = scales, alpha, [p.dtype for p in params]
        ctx.ranks, ctx.widths = [a.shape[0] for a in params[:count]], [b.shape[0] for b in params[count:]]
        return out

    @staticmethod
    def backward(ctx, grad):
        x, d, down, blocks, weight = ctx.saved_tensors
        needs, count = ctx.needs_input_grad, len(ctx.ranks)
        g = grad.reshape(-1, grad.shape[-1])
        d2, x2 = d.view(-1, d.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x, grad_a, grad_b = None, [None] * count, [None] * count
        first = 7  # the A's, then the B's
        if needs[0] or any(needs[first : first + count]):
            grad_d = torch.addmm(d2, g, blocks, beta=0, alpha=ctx.alpha)  # each adapter's scale B g, side by side
            if needs[0]:
                grad_x = torch.mm(g, weight).addmm_(grad_d, down).view(x.shape)
            if any(needs[first : first + count]):
                rows = product_in(ctx.dtypes[0], grad_d.t(), x2).split(ctx.ranks)
                grad_a = [r if n else None for r, n in zip(rows, needs[first : first + count], strict=True)]
        outs, ranks = g.split(ctx.widths, dim=1), d2.split(ctx.ranks, dim=1)
        for i in range(count):
            if needs[first + count + i]:
                grad_b[i] = product_in(ctx.dtypes[count + i], outs[i].t(), ranks[i], ctx.scales[i])
        return (grad_x, None, None, None, None, None, None, *grad_a, *grad_b)


# ---------------------------------------------------------------- rollouts, and joining weights on the device
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
        ``_joint``, elsewhere where :class:`~.TrainingJoin` allows."""
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
