"""One fused kernel where transformers launches several: what a GPU's backend swaps in.

A small model's GPU passes wait on kernel launches, a CUDA-graph step on its kernel count (docs/measurements.md).
Every swap here is checked once per class against the module's own forward on a random input, up to the float
rounding every backend choice may differ by (:mod:`.base`); modules that compute something else keep their forward.
:class:`FusedRMSNorm` (in front of a model's norm class, :mod:`.swap`) is ``torch.nn.functional.rms_norm``, one
kernel each way where transformers' Llama-style norm is several. It multiplies by the weight before rounding to the
model's dtype (transformers rounds first); Gemma's ``1 + weight`` norms keep theirs. Its backward keeps only the input
and one reciprocal root per row, so :mod:`.recompute` leaves these norms alone.

:class:`FusedRotaryAttention` (Llama, Qwen2, Mistral; not Qwen3's q/k norms or Gemma's soft-capping) rotates queries
and keys together in four kernels instead of ten (:func:`rotated`; ``sin'`` made once per forward, shared through one
:class:`~.memo.TensorMemo`), the fused multiply-add rounding once where transformers rounds twice. Inside a rollout
(:func:`~.passes.packed_for_pass` decoding) it multiplies by one concatenated copy of the q, k and v weights (LoRA's
merged copies written in): one product instead of three, each output the same dot product up to summation order.
"""

from __future__ import annotations

import torch

from ngrpo_lightning.backends.joined import JoinedProjections, join_weights
from ngrpo_lightning.backends.lora import LeanLoraLinear
from ngrpo_lightning.backends.memo import TensorMemo
from ngrpo_lightning.backends.packing import plain_linear
from ngrpo_lightning.backends.recompute import RecomputingGatedMLP
from ngrpo_lightning.backends.swap import forwards_agree, swap_checked
from ngrpo_lightning.compat.torch import has_forward_hooks
from ngrpo_lightning.compat.transformers import attention_function, kv_cache_argument, llama_attention


class FusedRMSNorm:
    """Mixin in front of a Llama-style RMSNorm: ``torch.nn.functional.rms_norm``, one kernel."""

    prefix = "Fused"
    why = "torch's fused rms_norm: one kernel forward and one in backward on a GPU"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:  # transformers' promotion, e.g. float32 weights on half inputs
            return super().forward(hidden_states)
        return torch.nn.functional.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def _is_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and not weight.is_meta
    )


def _eps(dtype: torch.dtype) -> float:
    """A rounding of ``dtype``, float32's at least: transformers' norms compute in float32."""
    return max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)


def within_roundings(own: torch.Tensor, new: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``new`` is ``own`` up to a few roundings of ``dtype``, relative to ``own``'s largest value."""
    return bool((own.float() - new.float()).abs().max() <= 8 * _eps(dtype) * own.float().abs().max())


def _norm_matches(module: torch.nn.Module) -> bool:
    """Whether the fused norm gives ``module``'s own output up to one rounding, on a random input."""
    weight = module.weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 3, weight.shape[0], generator=gen).to(device=weight.device, dtype=weight.dtype)
    eps = _eps(weight.dtype)
    return forwards_agree(
        module, FusedRMSNorm, x, agree=lambda own, new: torch.allclose(own.float(), new.float(), rtol=2 * eps, atol=eps)
    )


def signed_sin(sin: torch.Tensor, memo: TensorMemo | None = None) -> torch.Tensor:
    """``sin`` with its first half negated (``rotate_half(x) * sin == swap_halves(x) * sin'``), made once per
    forward where ``memo`` keeps it (every layer gets the same ``sin``)."""

    def make() -> torch.Tensor:
        half = sin.shape[-1] // 2
        return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)

    return make() if memo is None else memo.get(sin, "signed sin", make)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """``x`` with the two halves of its last dimension swapped (``roll`` by half of it): one kernel on a strided
    ``x`` too, where CUDA's ``roll`` copies a non-contiguous input first."""
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, memo: TensorMemo | None = None) -> torch.Tensor:
    """The rotary embedding of ``x`` [N, L, H, d] at ``cos``, ``sin`` [N, L, d]: ``x * cos + rotate_half(x) * sin``
    as one product, one swap of halves and one fused multiply-add (``memo``: as :func:`signed_sin`'s)."""
    return torch.addcmul(x * cos.unsqueeze(-2), swap_halves(x), signed_sin(sin, memo).unsqueeze(-2))


class FusedRotaryAttention(JoinedProjections):
    """Mixin in front of a Llama-style attention: queries and keys rotated together (:func:`rotated`),
    and inside a rollout queries, keys and values from one product (:mod:`.joined`)."""

    prefix = "Fused"
    why = "queries and keys rotated together in four kernels instead of ten; q, k, v in one product in rollouts"
    rotary_memo: TensorMemo | None = None  # sin' per forward, shared by the model's attentions (fused_modules)

    def projections(self) -> tuple[torch.nn.Module, ...]:
        """The query, key and value projections, which a rollout's one product stands for."""
        return (self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self,
        hidden_states,
        position_embeddings=None,
        attention_mask=None,
        past_key_values=None,
        residual=None,
        **kwargs,
    ):
        """transformers' attention (:func:`~ngrpo_lightning.compat.transformers.llama_attention` after the
        rotation); with ``residual`` (:class:`FusedDecoderLayer` in a rollout) the output projection's product is
        added onto it in one product (:func:`plus_product`)."""
        past_key_values = kv_cache_argument(past_key_values, kwargs)  # its name changed in transformers 5.24
        attend = attention_function(self.config)
        if position_embeddings is None or attend is None:  # e.g. eager attention: transformers' own forward
            out = super().forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
            return out if residual is None else (residual + out[0], *out[1:])
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        # (the swap's check runs this forward before the class is swapped: no joint_output or rotary_memo yet)
        qkv = self.joint_output(hidden_states) if hasattr(self, "joint_output") else None
        memo = getattr(self, "rotary_memo", None)
        if qkv is not None:  # [N, L, H + 2 H_kv, d], q and k adjacent
            heads, kv_heads = (p.out_features // self.head_dim for p in (self.q_proj, self.k_proj))
            qkv = qkv.view(hidden_shape)
            both = rotated(qkv[..., : heads + kv_heads, :], *position_embeddings, memo)
            value = qkv[..., heads + kv_heads :, :].transpose(1, 2)
        else:
            query = self.q_proj(hidden_states).view(hidden_shape)
            key = self.k_proj(hidden_states).view(hidden_shape)
            value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            heads = query.shape[-2]
            both = rotated(torch.cat([query, key], dim=-2), *position_embeddings, memo)  # [N, L, H + H_kv, d]
        query, key = both[..., :heads, :].transpose(1, 2), both[..., heads:, :].transpose(1, 2)
        out, weights = llama_attention(self, attend, query, key, value, attention_mask, past_key_values, **kwargs)
        return (self.o_proj(out) if residual is None else plus_product(residual, self.o_proj, out)), weights


def _is_attention(module: torch.nn.Module) -> bool:
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "layer_idx", "config", "scaling")
    return type(module).__name__.endswith("Attention") and all(hasattr(module, a) for a in names)


def _random_inputs(like: torch.Tensor, width: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """A random input of ``width`` features and rotary ``cos``, ``sin`` (2 rows of 5 positions), on ``like``'s
    device and dtype, the same at every call: what a swap's check runs."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 5, width, generator=gen)
    angles = torch.rand(2, 5, head_dim // 2, generator=gen) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return tuple(t.to(device=like.device, dtype=like.dtype) for t in (x, cos, sin))


def _attention_matches(module: torch.nn.Module) -> bool:
    """Whether :class:`FusedRotaryAttention` gives ``module``'s own output up to rounding, on a random input."""
    weight = module.q_proj.weight
    if weight.is_meta:
        return False
    x, cos, sin = _random_inputs(weight, weight.shape[1], module.head_dim)

    def agree(own, new):
        return within_roundings(own, new, weight.dtype)

    return forwards_agree(
        module, FusedRotaryAttention, x, position_embeddings=(cos, sin), attention_mask=None, agree=agree
    )


class FusedGatedMLP(JoinedProjections):
    """Mixin in front of a gated MLP (``down(act(gate(x)) * up(x))``: Llama, Qwen2, Mistral, Gemma): inside a
    rollout gate and up are one product (:mod:`.joined`). Plain weights (two thirds of a layer) are never copied:
    read in place where the backend joined them, else multiplied apart."""

    prefix = "Fused"
    why = "gate and up projections in one product in rollouts"
    copies_plain = False

    def projections(self) -> tuple[torch.nn.Module, ...]:
        return (self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP; with ``residual`` (:class:`FusedDecoderLayer` in a rollout) its output is added onto it, by the
        down projection's product itself where it can (:func:`plus_product`)."""
        gate_up = self.joint_output(x)
        if gate_up is None:
            return super().forward(x) if residual is None else residual + super().forward(x)
        return gated(self, gate_up, self.gate_proj.out_features, residual)

    def joins_in_training(self) -> bool:
        """Not where the backend recomputes the MLP's activations (its class tags the products)."""
        return not isinstance(self, RecomputingGatedMLP)


def gated(mlp: torch.nn.Module, gate_up: torch.Tensor, split: int, residual: torch.Tensor | None = None):
    """``down(act(gate) * up)`` (``+ residual``) from the gate's and up's outputs (``split``: the gate's width)."""
    hidden = mlp.act_fn(gate_up[..., :split]) * gate_up[..., split:]
    return mlp.down_proj(hidden) if residual is None else plus_product(residual, mlp.down_proj, hidden)


def plus_product(residual: torch.Tensor, projection: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``residual + projection(x)``: one ``addmm`` where ``projection`` multiplies by one weight and no bias (a
    plain layer, or a LoRA layer's merged copy in a rollout), the sum rounded once with the product; else apart."""
    weight = _weight_alone(projection)
    if weight is None:
        return residual + projection(x)
    out = torch.addmm(residual.reshape(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1]), weight.t())
    return out.view(residual.shape)


def _weight_alone(projection: torch.nn.Module) -> torch.Tensor | None:
    """The weight ``projection``'s forward multiplies by, with no bias and nothing else; else ``None``."""
    if has_forward_hooks(projection):
        return None
    if isinstance(projection, LeanLoraLinear):
        merged = projection._merged  # (weight or packed copy, bias, packed?) inside a rollout
        return merged[0] if merged is not None and merged[1] is None and not merged[2] else None
    return projection.weight if plain_linear(projection, every_pass=True) and projection.bias is None else None


def _is_gated_mlp(module: torch.nn.Module) -> bool:
    names = ("gate_proj", "up_proj", "down_proj", "act_fn")
    return type(module).__name__.endswith("MLP") and all(hasattr(module, a) for a in names)


def _mlp_matches(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is :class:`FusedGatedMLP`'s ``down(act(gate(x)) * up(x))`` up to rounding."""
    weight = getattr(module.gate_proj, "weight", None)
    if weight is None:
        weight = getattr(getattr(module.gate_proj, "base_layer", None), "weight", None)  # a LoRA layer
    if not isinstance(weight, torch.Tensor) or weight.is_meta:
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 3, weight.shape[1], generator=gen).to(device=weight.device, dtype=weight.dtype)
    try:
        with torch.no_grad():
            own, gate = module(x), module.gate_proj(x)
            new = gated(module, torch.cat([gate, module.up_proj(x)], -1), gate.shape[-1])
    except Exception:  # noqa: BLE001 - a module whose shape only looked familiar
        return False
    return own.shape == new.shape and within_roundings(own, new, weight.dtype)


class FusedDecoderLayer:
    """Mixin in front of a pre-norm decoder layer (``h = x + attn(norm(x))``, ``h + mlp(norm(h))``): inside a
    rollout, where its attention multiplies q, k and v as one product, each residual sum is made by the output and
    down projections' products themselves (:func:`plus_product`). Outside rollouts, the layer's own forward."""

    prefix = "Fused"
    why = "in rollouts the residual sums made by the output and down projections' products"

    def forward(self, hidden_states, *args, **kwargs):
        attention = self.self_attn
        if args or not isinstance(attention, FusedRotaryAttention) or attention._joint is None:
            return super().forward(hidden_states, *args, **kwargs)
        normed = self.input_layernorm(hidden_states)
        hidden_states, _ = attention(hidden_states=normed, residual=hidden_states, **kwargs)
        if isinstance(self.mlp, FusedGatedMLP):
            return self.mlp(self.post_attention_layernorm(hidden_states), residual=hidden_states)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def _is_decoder_layer(module: torch.nn.Module) -> bool:
    names = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    return type(module).__name__.endswith("DecoderLayer") and all(hasattr(module, a) for a in names)


def _layer_matches(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s forward is :class:`FusedDecoderLayer`'s pre-norm residual structure (not Gemma's)."""
    attention = layer.self_attn
    weight = getattr(getattr(attention, "o_proj", None), "weight", None)
    head_dim = getattr(attention, "head_dim", None)
    if not isinstance(weight, torch.Tensor) or weight.is_meta or not isinstance(head_dim, int):
        return False
    x, cos, sin = _random_inputs(weight, weight.shape[0], head_dim)
    was_training = layer.training
    layer.eval()
    try:
        with torch.no_grad():
            own = layer(x, attention_mask=None, position_embeddings=(cos, sin))
            own = own[0] if isinstance(own, tuple) else own
            normed = layer.input_layernorm(x)
            h = x + attention(hidden_states=normed, attention_mask=None, position_embeddings=(cos, sin))[0]
            new = h + layer.mlp(layer.post_attention_layernorm(h))
    except Exception:  # noqa: BLE001 - a layer whose shape only looked familiar
        return False
    finally:
        layer.train(was_training)
    return own.shape == new.shape and within_roundings(own, new, weight.dtype)


def fused_modules(model: torch.nn.Module, decoder_layers: bool = True) -> int:
    """Swap in :class:`FusedRMSNorm`, :class:`FusedRotaryAttention` and, with ``decoder_layers``,
    :class:`FusedDecoderLayer` where they match (see the module docstring); returns how many modules were swapped.
    The fused attentions share one memo for ``sin'`` (:func:`signed_sin`)."""

    def fusible(module: torch.nn.Module):
        if _is_norm(module):
            return FusedRMSNorm, _norm_matches
        if _is_attention(module):
            return FusedRotaryAttention, _attention_matches
        if decoder_layers and _is_decoder_layer(module):
            return FusedDecoderLayer, _layer_matches
        return None

    count = swap_checked(model, fusible)
    memo = TensorMemo()
    for module in model.modules():
        if isinstance(module, FusedRotaryAttention) and module.rotary_memo is None:
            module.rotary_memo = memo
    return count


def fused_mlps(model: torch.nn.Module) -> int:
    """Put :class:`FusedGatedMLP` in front of each gated MLP that matches, over whatever class the backend gave it
    already; returns how many."""

    def candidate(module):
        fusible = _is_gated_mlp(module) and not isinstance(module, FusedGatedMLP)
        return (FusedGatedMLP, _mlp_matches) if fusible else None

    return swap_checked(model, candidate, over_swapped=True)


def join_projections(model: torch.nn.Module) -> int:
    """Re-home the weights of each fused module's projections (LoRA's: their base layers') as row blocks of one
    tensor (:func:`~.joined.join_weights`), so a rollout multiplies by them in place and a training pass as one
    product; returns how many modules were joined (already joined ones count). For a model on its device, not
    sharded: only the modules joined here take the training passes' one product."""
    count = 0
    for m in model.modules():
        if isinstance(m, JoinedProjections):
            m.joined_on_device = join_weights(m.projections())
            count += m.joined_on_device
    return count
