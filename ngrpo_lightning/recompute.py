"""Cheap activations recomputed in backward instead of kept for it.

For backward, autograd keeps every tensor an op will need. In a Llama-style decoder layer a
good part of them is one elementwise op away from tensors that are kept anyway: each RMSNorm's
normalized input ``x * rstd`` and output ``weight * x * rstd`` (from ``x`` and ``rstd``, which
the norm's own backward keeps), and the MLP's ``act(gate)`` and ``act(gate) * up`` (from
``gate`` and ``up``, kept by the activation and the product). On the packaged model these are
0.95 of the 2.0 GiB a training forward over 1,540 tokens keeps (measured with a saved-tensor
tally, docs/performance.md), while recomputing them costs a few elementwise passes.

How. :func:`install` gives a model's RMSNorms and SwiGLU MLPs forwards that compute exactly
what transformers' do and register each such output with the recipe that recomputes it.
Inside :func:`recomputing`, a saved-tensor pack hook
(:class:`torch.autograd.graph.saved_tensors_hooks`) stores the recipe in place of a
registered tensor (or of a view of it), and the unpack hook recomputes it when backward
reaches the op that needs it: the same ops on the same inputs give the same bits, and
autograd's own backward formulas run unchanged, so losses and gradients are bit-identical to
keeping the tensors (tested). A module is patched only where its new forward gives exactly
its old output (checked once per class on a random input), so other architectures (Gemma's
``1 + weight`` norms, GELU MLPs) keep theirs. ``model.recompute_elementwise`` (default true)
turns it on for the policy's training forward.

One matmul is worth recomputing too: the MLP's ``up(x)`` [tokens, intermediate] is kept for the
product's backward, and its input ``x`` is a norm output that is itself recomputed (with LoRA
adapters on ``up_proj``, without dropout, the adapted layer's whole forward is recomputed).
``model.recompute_up_proj`` (default true) registers ``up`` with a recipe that recomputes the
norm and then the projection, once per layer in backward (the product's recipe and the
product's own backward share that value). On the packaged model's default run it cut the
process's peak from 4.16 to 3.86 GiB at the same time per step (docs/performance.md).
"""

from __future__ import annotations

import types
import weakref
from contextlib import contextmanager

import torch

_active = False  # registrations happen only inside `recomputing` (a training forward)
_recipes: dict[int, _Recipe] = {}  # storage address of a registered tensor -> its recipe
_refs: dict[int, weakref.ref] = {}  # storage address -> a weak reference that forgets it on death


class _Recipe:
    """How to recompute one registered tensor; caches the value while views of it wait."""

    __slots__ = ("fn", "args", "version", "nbytes", "pending", "value", "__weakref__")

    def __init__(self, fn, args, version: int, nbytes: int):
        self.fn, self.args, self.version, self.nbytes = fn, args, version, nbytes
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
    """What autograd keeps in place of a registered tensor (or a view of it)."""

    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: _Recipe, t: torch.Tensor):
        self.recipe, self.size, self.stride, self.offset = recipe, t.size(), t.stride(), t.storage_offset()


def _register(out: torch.Tensor, fn, *args) -> torch.Tensor:
    """Record that ``fn(*args)`` recomputes ``out``; returns ``out``."""
    if not _active or not out.requires_grad or not out.is_contiguous() or out.storage_offset() != 0:
        return out
    storage = out.untyped_storage()
    key = storage.data_ptr()
    recipe = _Recipe(fn, args, out._version, storage.nbytes())
    _recipes[key] = recipe

    def forget(_, key=key, recipe=recipe):  # `out` died: its address may be reused
        if _recipes.get(key) is recipe:
            del _recipes[key]
        _refs.pop(key, None)

    _refs[key] = weakref.ref(out, forget)
    return out


def _pack(t: torch.Tensor):
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return t
    recipe = _recipes.get(storage.data_ptr())
    if recipe is None or recipe.version != t._version or recipe.nbytes != storage.nbytes():
        return t
    recipe.pending += 1
    return _Packed(recipe, t)


def _unpack(saved):
    if isinstance(saved, _Packed):
        return saved.recipe.get().as_strided(saved.size, saved.stride, saved.offset)
    return saved


@contextmanager
def recomputing(enabled: bool = True):
    """Inside: tensors registered by :func:`install`'s forwards are recomputed in backward
    instead of kept. The backward itself may run after the context has closed."""
    global _active
    if not enabled or _active:
        yield
        return
    _active = True
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _active = False
        _recipes.clear()  # packed recipes live on in the graph; only the lookup table goes
        _refs.clear()


@contextmanager
def tallying_kept(kept: dict[int, int], skip: frozenset[int] = frozenset()):
    """Inside :func:`recomputing`, also record what autograd keeps for backward: ``kept`` maps
    each kept storage's address to its bytes (a storage counts once however many views of it
    are saved; recomputed tensors and storages in ``skip``, e.g. the parameters', not at all)."""

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

    with recomputing(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        yield kept


def rows_then_new(prefix: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``cat([prefix[rows], new], dim=-2)``, registered: attention keeps this per-row copy of a
    shared prompt's keys or values for backward, and it is two copies away from ``prefix`` (one
    row per distinct prompt, kept by the prompt's own pass) and ``new`` (the rows' own)."""
    return _register(_rows_then_new(prefix, rows, new), _rows_then_new, prefix, rows, new)


def _rows_then_new(prefix: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return torch.cat([prefix.index_select(0, rows), new], dim=-2)


# ---------------------------------------------------------------- patched forwards
UP_FLAG = "_ngrpo_recompute_up"  # an MLP's attribute: its up projection is recomputed too (install(up_proj=True))


def _scaled(weight: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight * (x * rstd).to(dtype)


def _cast_normed(x: torch.Tensor, rstd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x * rstd).to(dtype)


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' Llama RMSNorm, op for op, with its normalized input and output registered."""
    dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    normed = _register(x * rstd, torch.mul, x, rstd)
    cast = normed.to(dtype)
    if cast is not normed:  # a half-precision model keeps the cast copy for the weight's gradient
        _register(cast, _cast_normed, x, rstd, dtype)
    return _register(self.weight * cast, _scaled, self.weight, x, rstd, dtype)


def _act_times(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act(gate) * up


def _recipe_of(t: torch.Tensor) -> _Recipe | None:
    """The recipe registered for the whole of ``t``, unchanged since, if any."""
    recipe = _recipes.get(t.untyped_storage().data_ptr()) if t.storage_offset() == 0 else None
    if recipe is None or recipe.version != t._version or recipe.nbytes != t.untyped_storage().nbytes():
        return None
    return recipe


def _layer_of(source: _Recipe, layer: torch.nn.Module) -> torch.Tensor:
    # the layer's own forward, as in the forward pass (a packed product, a LoRA layer's sum)
    return layer(source.fn(*source.args))


def _recomputable(layer: torch.nn.Module) -> bool:
    """Whether running ``layer`` again on the same input gives the same bits: a plain linear
    layer, or a LoRA layer whose adapters see their input as is (no dropout: a recompute would
    draw another mask)."""
    if type(layer) is torch.nn.Linear:
        return True
    dropouts = getattr(layer, "lora_dropout", None)
    return (
        hasattr(layer, "base_layer")
        and dropouts is not None
        and all(isinstance(d, torch.nn.Identity) for d in dropouts.values())
    )


def _act_times_recomputed(act, gate: torch.Tensor, up: _Recipe) -> torch.Tensor:
    return act(gate) * up.peek()  # the product's recompute leaves `up` cached for the product's own backward


def gated_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` (Llama, Qwen, Mistral MLPs), with ``act(gate)`` and the
    product registered, and ``up`` too where its input is a registered norm output."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    act = _register(self.act_fn(gate), self.act_fn, gate)
    up_too = _active and getattr(self, UP_FLAG, False) and _recomputable(self.up_proj)
    source = _recipe_of(x) if up_too else None
    if source is not None:
        _register(up, _layer_of, source, self.up_proj)
        up_recipe = _recipe_of(up)  # None where `up` could not be registered: it is kept as before
        if up_recipe is not None:
            return self.down_proj(_register(act * up, _act_times_recomputed, self.act_fn, gate, up_recipe))
    return self.down_proj(_register(act * up, _act_times, self.act_fn, gate, up))


def _candidate(module: torch.nn.Module):
    """The recomputing forward that may replace ``module``'s, by the module's shape."""
    name = type(module).__name__
    if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and isinstance(module.weight, torch.Tensor):
        return rms_norm_forward
    if name.endswith("MLP") and all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return gated_mlp_forward
    return None


def _same_output(module: torch.nn.Module, forward) -> bool:
    """Whether ``forward`` gives exactly ``module``'s own output, on a random input."""
    weight = next(module.parameters(), None)
    if weight is None or weight.is_meta:
        return False
    width = getattr(module, "hidden_size", None) or weight.shape[-1]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 3, width, generator=gen).to(device=weight.device, dtype=weight.dtype)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return torch.equal(type(module).forward(module, x), forward(module, x))
    except Exception:  # a module whose shape only looked familiar
        return False
    finally:
        module.train(was_training)


def install(model: torch.nn.Module, up_proj: bool = False) -> int:
    """Give ``model``'s RMSNorms and gated MLPs their recomputing forwards, where these give
    exactly the same outputs (checked once per class); returns how many modules got one.
    ``up_proj``: the MLPs recompute their up projection too (a plain ``nn.Linear`` fed by a
    patched norm): one more matmul per layer in backward, for one [tokens, intermediate]
    tensor per layer less kept. A LoRA ``up_proj`` (peft's ``lora.Linear``) is recomputed whole."""
    checked: dict[type, bool] = {}
    count = 0
    for module in model.modules():
        forward = _candidate(module)
        if forward is None:
            continue
        cls = type(module)
        if cls not in checked:
            checked[cls] = _same_output(module, forward)
        if checked[cls]:
            module.forward = types.MethodType(forward, module)
            if forward is gated_mlp_forward:
                setattr(module, UP_FLAG, up_proj)
            count += 1
    return count
