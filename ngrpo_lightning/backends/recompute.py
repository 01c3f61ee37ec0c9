"""Cheap activations recomputed in backward instead of kept for it.

In a Llama-style decoder layer much of what autograd keeps is one elementwise op away from tensors kept anyway: each
RMSNorm's normalized input and output (from ``x`` and ``rstd``), the MLP's ``act(gate)`` and ``act(gate) * up``, and
``up(x)``, whose input is a recomputed norm output. :func:`recomputing_modules` swaps RMSNorms and gated MLPs for
classes (:class:`RecomputingRMSNorm`, :class:`RecomputingGatedMLP`) that compute exactly what transformers' do and tag
each such output with its recipe. Inside :func:`recomputing` (a training forward) a saved-tensor pack hook stores the
recipe in place of a tagged tensor (or a view of it) and the unpack hook recomputes it: the same ops on the same
inputs, so losses and gradients are bit-identical (tested). The forward's :class:`Recomputation` keeps recipes by
tensor identity without keeping tensors alive, in a context variable a rollout on another thread never sees. A module
is swapped only where its new forward gives exactly its old output (checked once per class), so other architectures
(Gemma's ``1 + weight`` norms, GELU MLPs) keep theirs.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ngrpo_lightning.backends.swap import forwards_agree, swap_checked
from ngrpo_lightning.compat.torch import base_of, tensor_version


class _Recipe:
    """How to recompute one tagged tensor; caches the value while views of it wait."""

    __slots__ = ("fn", "args", "version", "pending", "value")

    def __init__(self, fn, args, version: int):
        self.fn, self.args, self.version = fn, args, version
        self.pending, self.value = 0, None

    def peek(self) -> torch.Tensor:
        """The value, computed once and cached until the saved views have read it."""
        if self.value is None:
            with torch.no_grad():
                self.value = self.fn(*self.args)
        return self.value

    def get(self) -> torch.Tensor:
        self.peek()
        self.pending -= 1
        value = self.value
        if self.pending <= 0:  # the last view that was saved has been read: drop the cache
            self.value = None
        return value


class _Packed:
    """What autograd keeps in place of a tagged tensor (or a view of it)."""

    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: _Recipe, t: torch.Tensor):
        self.recipe, self.size, self.stride, self.offset = recipe, t.size(), t.stride(), t.storage_offset()


class Recomputation:
    """The recipes of one recording forward (:func:`recomputing`), by tagged tensor identity; a recipe goes when its
    tensor does, or with the graph that packed it."""

    def __init__(self):
        self.recipes = WeakIdKeyDictionary()  # tagged tensor -> its _Recipe

    def tag(self, out: torch.Tensor, fn, args: tuple) -> None:
        if out.requires_grad and base_of(out) is None and out.is_contiguous() and out.storage_offset() == 0:
            self.recipes[out] = _Recipe(fn, args, tensor_version(out))

    def recipe_of(self, t: torch.Tensor) -> _Recipe | None:
        """The recipe of ``t`` or of the tensor it views, if unchanged since it was tagged."""
        base = base_of(t)
        recipe = self.recipes.get(t if base is None else base)
        if recipe is None or recipe.version != tensor_version(t):
            return None
        return recipe

    def pack(self, t: torch.Tensor):
        """The saved-tensor pack hook: a tagged tensor (or a view of one) is kept as its recipe."""
        recipe = self.recipe_of(t)
        if recipe is None:
            return t
        recipe.pending += 1
        return _Packed(recipe, t)


_recording: contextvars.ContextVar[Recomputation | None] = contextvars.ContextVar("ngrpo_recomputing", default=None)


def tag(out: torch.Tensor, fn, *args) -> torch.Tensor:
    """Record that ``fn(*args)`` recomputes ``out`` (inside a recording forward); returns ``out``."""
    recording = _recording.get()
    if recording is not None:
        recording.tag(out, fn, args)
    return out


def recipe_of(t: torch.Tensor, recording: Recomputation | None = None) -> _Recipe | None:
    """:meth:`Recomputation.recipe_of` in ``recording`` (default: this context's); ``None`` outside a recording."""
    recording = recording if recording is not None else _recording.get()
    return None if recording is None else recording.recipe_of(t)


def _pack(t: torch.Tensor):
    recording = _recording.get()
    return t if recording is None else recording.pack(t)


def _unpack(saved):
    if isinstance(saved, _Packed):
        return saved.recipe.get().as_strided(saved.size, saved.stride, saved.offset)
    return saved


@contextmanager
def recomputing(enabled: bool = True, pack=_pack):
    """Inside, tagged tensors are recomputed in backward instead of kept (backward may run after the context
    closed). ``pack``: the saved-tensor hook. Gives the forward's :class:`Recomputation` (the enclosing one inside
    another; ``None`` where not ``enabled``)."""
    if not enabled or _recording.get() is not None:
        yield _recording.get()
        return
    recording = Recomputation()
    token = _recording.set(recording)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield recording
    finally:
        _recording.reset(token)


@contextmanager
def tallying_kept(kept: dict[int, int], skip: frozenset[int] = frozenset()):
    """Inside :func:`recomputing`, also record what autograd keeps: ``kept`` maps each kept storage's address to
    its bytes (once per storage; recomputed tensors and storages in ``skip`` not at all). For measurements only."""

    def pack(t: torch.Tensor):
        packed = _pack(t)
        if not isinstance(packed, _Packed):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return packed
            if storage.data_ptr() not in skip:
                kept[storage.data_ptr()] = storage.nbytes()
        return packed

    with recomputing(pack=pack):
        yield kept


def rows_then_new(prefix: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``cat([prefix[rows], new], dim=-2)``, tagged: attention's per-row copy of a shared prompt's keys or values,
    cheap to remake from ``prefix`` and ``new``, which are kept anyway."""
    return tag(_rows_then_new(prefix, rows, new), _rows_then_new, prefix, rows, new)


def _rows_then_new(prefix: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return torch.cat([prefix.index_select(0, rows), new], dim=-2)


# ---------------------------------------------------------------- the swapped modules
def _scaled(weight: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight * (x * rstd).to(dtype)


def _cast_normed(x: torch.Tensor, rstd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x * rstd).to(dtype)


class RecomputingRMSNorm:
    """transformers' Llama-style RMSNorm, op for op, with its normalized input and output tagged."""

    prefix = "Recomputing"
    why = "its normalized input and output recomputed in backward (bit-identical)"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        normed = tag(x * rstd, torch.mul, x, rstd)
        cast = normed.to(dtype)
        if cast is not normed:  # a half-precision model keeps the cast copy for the weight's gradient
            tag(cast, _cast_normed, x, rstd, dtype)
        return tag(self.weight * cast, _scaled, self.weight, x, rstd, dtype)


def _act_times(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act(gate) * up


def _layer_of(source: _Recipe, layer: torch.nn.Module) -> torch.Tensor:
    # the layer's own forward, as in the forward pass (a packed product, a LoRA layer's sum)
    return layer(source.fn(*source.args))


def _act_times_recomputed(act, gate: torch.Tensor, up: _Recipe) -> torch.Tensor:
    return act(gate) * up.peek()  # the product's recompute leaves `up` cached for the product's own backward


def recomputes(model: torch.nn.Module) -> bool:
    """Whether any module of ``model`` recomputes its outputs (then a training forward runs in :func:`recomputing`)."""
    return any(isinstance(m, (RecomputingRMSNorm, RecomputingGatedMLP)) for m in model.modules())


def recomputable(layer: torch.nn.Module) -> bool:
    """Whether running ``layer`` again on the same input gives the same bits: a linear layer, or a LoRA layer
    without dropout (a recompute would draw another mask)."""
    dropouts = getattr(layer, "lora_dropout", None)
    if dropouts is not None:
        return hasattr(layer, "base_layer") and all(isinstance(d, torch.nn.Identity) for d in dropouts.values())
    return isinstance(layer, torch.nn.Linear)


class RecomputingGatedMLP:
    """``down(act(gate(x)) * up(x))`` (Llama, Qwen, Mistral), ``act(gate)`` and the product tagged, and ``up`` too
    where its input is a tagged norm output."""

    prefix = "Recomputing"
    why = "act(gate), act(gate) * up and the up projection recomputed in backward (bit-identical)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        act = tag(self.act_fn(gate), self.act_fn, gate)
        source = recipe_of(x) if _recording.get() is not None and recomputable(self.up_proj) else None
        if source is not None:
            up_recipe = recipe_of(tag(up, _layer_of, source, self.up_proj))
            if up_recipe is not None:  # None where `up` could not be tagged: it is kept as before
                return self.down_proj(tag(act * up, _act_times_recomputed, self.act_fn, gate, up_recipe))
        return self.down_proj(tag(act * up, _act_times, self.act_fn, gate, up))


def _candidate(module: torch.nn.Module) -> tuple[type, object] | None:
    """The recomputing class that may go in front of ``module``'s, by the module's shape, and its check."""
    name = type(module).__name__
    if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and isinstance(module.weight, torch.Tensor):
        return RecomputingRMSNorm, _same_output
    if name.endswith("MLP") and all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return RecomputingGatedMLP, _same_output
    return None


def _same_output(module: torch.nn.Module) -> bool:
    """Whether the recomputing class gives exactly ``module``'s own output, on a random input."""
    weight = next(module.parameters(), None)
    if weight is None or weight.is_meta:
        return False
    width = getattr(module, "hidden_size", None) or weight.shape[-1]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 3, width, generator=gen).to(device=weight.device, dtype=weight.dtype)
    return forwards_agree(module, _candidate(module)[0], x)


def recomputing_modules(model: torch.nn.Module) -> int:
    """Swap ``model``'s RMSNorms and gated MLPs for their recomputing classes where the outputs match exactly
    (see the module docstring); returns how many modules were swapped."""
    return swap_checked(model, _candidate)
