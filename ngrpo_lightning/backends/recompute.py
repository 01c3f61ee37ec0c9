"""Cheap activations recomputed in backward instead of kept for it.

For backward, autograd keeps every tensor an op will need. In a Llama-style decoder layer a
good part of them is one elementwise op away from tensors that are kept anyway: each RMSNorm's
normalized input ``x * rstd`` and output ``weight * x * rstd`` (from ``x`` and ``rstd``, which
the norm's own backward keeps), and the MLP's ``act(gate)`` and ``act(gate) * up`` (from
``gate`` and ``up``, kept by the activation and the product). On the packaged model these are
about half of what a training forward keeps, while recomputing them costs a few elementwise
passes. One matmul is worth recomputing too: the MLP's ``up(x)`` [tokens, intermediate] is kept
for the product's backward, and its input ``x`` is a norm output that is itself recomputed (a
LoRA ``up_proj`` without dropout is recomputed whole).

How. :func:`recomputing_modules` swaps a model's RMSNorms and gated MLPs for classes
(:class:`RecomputingRMSNorm`, :class:`RecomputingGatedMLP`, in front of the model's own) that
compute exactly what transformers' do and tag each such output with the recipe that recomputes
it. Inside :class:`Recomputation` (a training forward), a saved-tensor pack hook
(:class:`torch.autograd.graph.saved_tensors_hooks`) stores the recipe in place of a tagged
tensor (or of a view of it), and the unpack hook recomputes it when backward reaches the op that
needs it: the same ops on the same inputs give the same bits, and autograd's own backward
formulas run unchanged, so losses and gradients are bit-identical to keeping the tensors
(tested). The recipe travels on the tensor itself; which forward is recording is a context
variable, so a rollout on another thread (decoding without gradients) never sees it. A module is
swapped only where its new forward gives exactly its old output (checked once per class on a
random input), so other architectures (Gemma's ``1 + weight`` norms, GELU MLPs) keep theirs.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch

from ngrpo_lightning.backends.swap import forwards_agree, swap_checked

_recording: contextvars.ContextVar[bool] = contextvars.ContextVar("ngrpo_recomputing", default=False)
RECIPE = "_ngrpo_recipe"  # the attribute of a tagged tensor that holds its recipe


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


def tag(out: torch.Tensor, fn, *args) -> torch.Tensor:
    """Record on ``out`` that ``fn(*args)`` recomputes it (inside a recording forward); returns ``out``."""
    if _recording.get() and out.requires_grad and out._base is None and out.is_contiguous():
        if out.storage_offset() == 0:
            setattr(out, RECIPE, _Recipe(fn, args, out._version))
    return out


def recipe_of(t: torch.Tensor) -> _Recipe | None:
    """The recipe of ``t`` or of the tensor it views, if unchanged since it was tagged."""
    owner = t if t._base is None else t._base
    recipe = owner.__dict__.get(RECIPE) if hasattr(owner, "__dict__") else None
    if recipe is None or recipe.version != t._version:
        return None
    return recipe


def _pack(t: torch.Tensor):
    recipe = recipe_of(t)
    if recipe is None:
        return t
    recipe.pending += 1
    return _Packed(recipe, t)


def _unpack(saved):
    if isinstance(saved, _Packed):
        return saved.recipe.get().as_strided(saved.size, saved.stride, saved.offset)
    return saved


@contextmanager
def recomputing(enabled: bool = True, pack=_pack):
    """Inside: tensors tagged by the recomputing modules' forwards are recomputed in backward
    instead of kept. The backward itself may run after the context has closed. ``pack``: the
    saved-tensor hook (a tally of what is kept wraps the default)."""
    if not enabled or _recording.get():
        yield
        return
    token = _recording.set(True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield
    finally:
        _recording.reset(token)


@contextmanager
def tallying_kept(kept: dict[int, int], skip: frozenset[int] = frozenset()):
    """Inside :func:`recomputing`, also record what autograd keeps for backward: ``kept`` maps
    each kept storage's address to its bytes (a storage counts once however many views of it
    are saved; recomputed tensors and storages in ``skip``, e.g. the parameters', not at all).
    For measurements: the addresses are read, never used to find a tensor."""

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
    """``cat([prefix[rows], new], dim=-2)``, tagged: attention keeps this per-row copy of a
    shared prompt's keys or values for backward, and it is two copies away from ``prefix`` (one
    row per distinct prompt, kept by the prompt's own pass) and ``new`` (the rows' own)."""
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
    """Whether any module of ``model`` recomputes its outputs (then a training forward runs inside
    :func:`recomputing`; without one, its saved-tensor hooks would only cost time)."""
    return any(isinstance(m, (RecomputingRMSNorm, RecomputingGatedMLP)) for m in model.modules())


def recomputable(layer: torch.nn.Module) -> bool:
    """Whether running ``layer`` again on the same input gives the same bits: a linear layer, or a
    LoRA layer whose adapters see their input as is (no dropout: a recompute would draw another mask)."""
    dropouts = getattr(layer, "lora_dropout", None)
    if dropouts is not None:
        return hasattr(layer, "base_layer") and all(isinstance(d, torch.nn.Identity) for d in dropouts.values())
    return isinstance(layer, torch.nn.Linear)


class RecomputingGatedMLP:
    """``down(act(gate(x)) * up(x))`` (Llama, Qwen, Mistral MLPs), with ``act(gate)`` and the
    product tagged, and ``up`` too where its input is a tagged norm output."""

    prefix = "Recomputing"
    why = "act(gate), act(gate) * up and the up projection recomputed in backward (bit-identical)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        act = tag(self.act_fn(gate), self.act_fn, gate)
        source = recipe_of(x) if _recording.get() and recomputable(self.up_proj) else None
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
    """Swap ``model``'s RMSNorms and gated MLPs for their recomputing classes, where these give
    exactly the same outputs (checked once per class); returns how many modules were swapped."""
    return swap_checked(model, _candidate)
