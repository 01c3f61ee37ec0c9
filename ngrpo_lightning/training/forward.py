"""The training forward: log-probs of a rollout's response tokens under a model.

The inputs are rebuilt from the rollout's tokens and records: exactly what the rollout saw (mixed steps included).
``log_softmax(model(...).logits)`` would hold about three float32 [N, L, V] tensors (7 GiB for 2 x 2,048 tokens at
V = 151,936), so the LM head is applied ``chunk_size`` tokens at a time in one autograd function that recomputes each
chunk's logits in backward (:class:`ChunkedTokenLogprobs`): a few [chunk_size, V] tensors whatever the response
length, a softmax that fits ``keep_softmax_mib`` kept for backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicLayer

from ngrpo_lightning.backends.base import Backend
from ngrpo_lightning.backends.packing import BackendLinear, add_head_weight_grad
from ngrpo_lightning.backends.recompute import rows_then_new
from ngrpo_lightning.compat.torch import linear_pointwise
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.rollout.reconstruction import build_inputs_embeds

# The backend's defaults (backends/base.py says why these sizes)
DEFAULT_LOGPROB_CHUNK = Backend.logprob_chunk_size
DEFAULT_KEEP_SOFTMAX_MIB = Backend.keep_softmax_mib

# Config attributes of models whose logits are not just ``lm_head(hidden)``: they take the full-logits path
LOGIT_TRANSFORM_ATTRS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "logits_soft_cap",
    "output_multiplier",
    "unpadded_vocab_size",
)


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens, as ``generate`` does for left padding."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of ``softmax(logits)`` ([..., V] -> [...])."""
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def split_lm_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """``(decoder, head)`` when ``model``'s logits are exactly ``head(decoder(...).last_hidden_state)`` for a plain
    ``nn.Linear`` head; ``None`` otherwise (see :data:`LOGIT_TRANSFORM_ATTRS`)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(c, name, None) is not None for c in (config, text_config) for name in LOGIT_TRANSFORM_ATTRS):
        return None
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if type(head) not in (torch.nn.Linear, BackendLinear):  # the backend's head computes what nn.Linear does
        return None
    decoder = None
    if hasattr(model, "get_decoder"):
        try:
            decoder = model.get_decoder()
        except (AttributeError, NotImplementedError, ValueError):
            decoder = None
    if decoder is None or decoder is model:
        decoder = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(decoder, torch.nn.Module) or decoder is model:
        return None
    return decoder, head


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``log_softmax(head(hidden) / T)[target]`` for M tokens, ``chunk`` tokens at a time. Forward keeps each token's
    log-sum-exp; backward recomputes every chunk's logits and turns them into the gradient in place, one [chunk, V]
    buffer at a time: ``d logp / d z = (onehot(target) - softmax(z)) / T``, ``d hidden = dz @ W``,
    ``d W += dz^T @ hidden``. Softmax in float32 (float64 for a float64 head), the head's matmuls in its dtype, a
    low-precision head's weight gradient accumulated in float32; the entropy is not differentiable. ``keep``: forward
    stores the [M, V] float32 softmax for backward instead of recomputing (:func:`chunked_token_logprobs` decides).
    ``packed``: the head's products run on oneDNN (the CPU backend's measured choice for the head, ``pack_logits``),
    which reads the weight as it lies; ``d W`` is summed a slice of ``V`` at a time."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temperature: float, chunk: int, with_entropy: bool, keep: bool, packed=False
    ):
        m = hidden.shape[0]
        logp = torch.empty(m, dtype=_softmax_dtype(weight), device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        kept = logp.new_empty(m, weight.shape[0]) if keep else logp.new_empty(0)
        for start in range(0, m, chunk):  # one [chunk, V] buffer at a time, worked on in place
            part = slice(start, start + chunk)
            z = _chunk_logits(hidden[part], weight, bias, temperature, packed)
            target_logit = z.gather(-1, targets[part, None]).squeeze(-1)
            top = z.amax(-1, keepdim=True)
            if keep:  # z - max stays for the entropy; exp(z - max) goes to the kept softmax
                e = torch.exp(z.sub_(top), out=kept[part])
                total = e.sum(-1)
                if with_entropy:  # H = log S - sum(e * (z - max)) / S, without a [chunk, V] product
                    entropy[part] = total.log() - torch.bmm(e[:, None], z[:, :, None]).view(-1) / total
                e.div_(total[:, None])
            else:
                total = z.sub_(top).exp_().sum(-1)  # z now holds exp(z - max)
                if with_entropy:  # in place, no second name for z: the next chunk's logits reuse its memory
                    entropy[part] = torch.special.entr(z.div_(total[:, None]), out=z).sum(-1)  # -p log p, 0 at p = 0
            lse[part] = top.squeeze(-1) + total.log()
            logp[part] = target_logit - lse[part]
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse, kept)
        ctx.temperature, ctx.chunk, ctx.keep, ctx.packed = temperature, chunk, keep, packed
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, lse, kept = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        temperature, chunk = ctx.temperature, ctx.chunk
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        acc = _softmax_dtype(weight)
        grad_weight = None  # the first chunk's product, then the sum (float32 for a half-precision head)
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_bias else None
        for start in range(0, hidden.shape[0], chunk):
            part = slice(start, start + chunk)
            g = grad_logp[part].to(acc) / temperature
            if ctx.keep:  # the forward's softmax, left as it is (a retained graph may run backward again)
                dz = kept[part].mul(-g[:, None])
            else:
                dz = _chunk_logits(hidden[part], weight, bias, temperature, ctx.packed).sub_(lse[part, None]).exp_()
                dz.mul_(-g[:, None])
            dz.scatter_add_(1, targets[part, None], g[:, None])
            if need_bias:
                grad_bias += dz.sum(0)
            dz = dz.to(weight.dtype)
            if need_hidden:  # with ``packed``: the same products on oneDNN, operands as they lie
                grad_hidden[part] = linear_pointwise(dz, weight.t(), None) if ctx.packed else dz @ weight
            if need_weight:
                h = hidden[part].to(weight.dtype)
                if ctx.packed:
                    grad_weight = add_head_weight_grad(grad_weight, dz, h, acc)
                elif grad_weight is None:  # no zeroed [V, d] buffer to add the first product to
                    grad_weight = (dz.t() @ h).to(acc)
                elif weight.dtype == acc:
                    grad_weight.addmm_(dz.t(), h)
                else:  # a half-precision product, widened to float32 as it is added
                    grad_weight += dz.t() @ h
            del dz
        if need_weight:
            grad_weight = torch.zeros_like(weight) if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = grad_bias.to(bias.dtype) if need_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _softmax_dtype(weight: torch.Tensor) -> torch.dtype:
    """float32, or float64 for a float64 head (exact comparisons in tests)."""
    return torch.promote_types(weight.dtype, torch.float32)


def _chunk_logits(hidden, weight, bias, temperature: float, packed: bool = False) -> torch.Tensor:
    """Float32 logits / T of one chunk [chunk, V]: the head in its own dtype, as the model computes it. ``packed``:
    on oneDNN, which reads the head's weight as it lies (no copy of it is made)."""
    h = hidden.to(weight.dtype)
    z = linear_pointwise(h, weight, bias) if packed else torch.nn.functional.linear(h, weight, bias)
    z = z.to(_softmax_dtype(weight))
    return z.div_(temperature) if temperature != 1.0 else z


def chunked_token_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_LOGPROB_CHUNK,
    with_entropy: bool = False,
    keep_softmax_mib: float = DEFAULT_KEEP_SOFTMAX_MIB,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [M] of ``targets`` under ``softmax(head(hidden) / T)`` for hidden states [M, d], and optionally the
    detached entropies [M], ``chunk_size`` tokens' logits at a time. A softmax of at most ``keep_softmax_mib`` MiB is
    kept for backward (0: always recompute, the memory floor)."""
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    keep = needs_grad and hidden.shape[0] * head.weight.shape[0] * 4 <= keep_softmax_mib * 2**20
    packed = getattr(head, "pack_logits", False) and hidden.device.type == "cpu"  # the backend's choice
    logp, entropy = ChunkedTokenLogprobs.apply(
        hidden, head.weight, head.bias, targets, float(temperature), int(chunk_size), bool(with_entropy), keep, packed
    )
    return logp, entropy if with_entropy else None


def response_logprobs(
    model: torch.nn.Module,
    batch: RolloutBatch,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    detach_mixture: bool = False,
    use_records: bool = True,
    chunk_size: int | None = DEFAULT_LOGPROB_CHUNK,
    keep_softmax_mib: float = DEFAULT_KEEP_SOFTMAX_MIB,
    share_prompts: bool | str = False,
    before_head: Callable[[], object] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N, L] of ``batch.response_ids`` (0 on padding) and, optionally, the detached entropy [N, L].

    ``chunk_size`` tokens of LM-head logits at a time (:func:`chunked_token_logprobs`); ``None`` takes the full-logits
    path, also taken by models whose logits are not a plain linear head (:func:`split_lm_head`). Both paths agree up
    to float rounding. ``share_prompts``: rows with the same prompt run its tokens once
    (:func:`_hidden_with_shared_prompts`); chunked path only, not under activation checkpointing. ``"always"`` splits
    the passes even where no prompt repeats (every rank then calls the decoder as often). ``use_records=False``
    ignores the mixed steps: a negative control. ``before_head``: called between the decoder and the chunked LM head
    (the backend hands the decoder's freed temporaries back there, before the head's [chunk, V] buffers).
    """
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(
            f"chunk_size={chunk_size!r}: the LM-head chunk must be a positive number of tokens "
            "(or None for the full-logits path)"
        )
    temperature = temperature or 1.0  # log-probs of a greedy policy are taken at T=1
    embedding = model.get_input_embeddings().weight
    mask = batch.attention_mask
    records = batch.records if use_records else None
    length = batch.response_ids.shape[1]

    def whole_sequence_inputs() -> dict:  # prompt and response in one pass
        embeds = build_inputs_embeds(embedding, batch.input_ids, records, batch.response_offset, detach_mixture)
        positions = position_ids_from_mask(mask)
        return dict(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=False)

    split = split_lm_head(model) if chunk_size is not None else None
    if split is None:
        out = model(**whole_sequence_inputs(), logits_to_keep=length + 1)
        logits = out.logits[:, :-1].float() / temperature  # position t predicts response token t
        logp = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
        logp = logp * batch.response_mask
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = token_entropy(logits.detach())
        return logp, entropy

    decoder, head = split
    # only real response tokens reach the head; found first, since ``nonzero`` waits for the device
    keep = batch.response_mask.bool()
    where = keep.nonzero(as_tuple=True)
    shared = shared_prompts(batch, always=share_prompts == "always") if share_prompts else None
    if shared is not None:
        hidden = _hidden_with_shared_prompts(decoder, embedding, batch, records, detach_mixture, *shared)
    else:
        out = decoder(**whole_sequence_inputs())
        hidden = _last_hidden(out)[:, -(length + 1) : -1]  # as logits_to_keep=length+1, then [:, :-1]
    if before_head is not None:
        before_head()
    token_logp, token_entropy_ = chunked_token_logprobs(
        hidden[where], head, batch.response_ids[where], temperature, chunk_size, with_entropy, keep_softmax_mib
    )
    logp = token_logp.new_zeros(keep.shape).index_put(where, token_logp)
    entropy = None if token_entropy_ is None else token_entropy_.new_zeros(keep.shape).index_put(where, token_entropy_)
    return logp, entropy


# ---------------------------------------------------------------- prompts shared by a group
def _last_hidden(out) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def shared_prompts(batch: RolloutBatch, always: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first, inverse)`` when rows repeat a prompt: ``first`` [U] is a row of each distinct prompt, ``inverse`` [N]
    the index into ``first`` of every row's prompt. ``None`` when every prompt is distinct, unless ``always``: then
    every row its own."""
    key = torch.cat([batch.prompt_ids * batch.prompt_mask, batch.prompt_mask], dim=1)
    unique, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(len(batch), device=inverse.device)
    if len(unique) == len(batch):
        return (rows, rows) if always else None
    first = torch.full((len(unique),), len(batch), device=inverse.device).scatter_reduce(0, inverse, rows, "amin")
    return first, inverse


def _hidden_with_shared_prompts(decoder, embedding, batch, records, detach_mixture, first, inverse) -> torch.Tensor:
    """Final hidden states [N, L, d] of the positions predicting the response tokens, each distinct prompt run once
    (Prefix Grouper, arXiv 2506.05433): the responses attend to the prompts' keys and values, repeated per sample,
    and gradients flow back through them into the one prompt pass."""
    # the responses' inputs first: rebuilding them reads the device, after the prompts' pass a long wait
    response_embeds = build_inputs_embeds(embedding, batch.response_ids, records, 0, detach_mixture)
    prompt_mask = batch.prompt_mask[first]
    prompt = decoder(
        inputs_embeds=torch.nn.functional.embedding(batch.prompt_ids[first], embedding),
        attention_mask=prompt_mask,
        position_ids=position_ids_from_mask(prompt_mask),
        use_cache=True,
    )
    cache = _read_only_prefix(prompt.past_key_values, inverse)  # the prompt's keys and values, per sample
    mask = batch.attention_mask
    response = decoder(
        inputs_embeds=response_embeds,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask)[:, batch.response_offset :],
        past_key_values=cache,
        use_cache=True,
    )
    # position t predicts response token t: the prompt's last position, then the response's
    last_prompt = _last_hidden(prompt)[:, -1:][inverse]
    return torch.cat([last_prompt, _last_hidden(response)[:, :-1]], dim=1)


class SharedPrefixLayer(DynamicLayer):
    """One layer's keys and values of the distinct prompts: ``update`` returns each row's prompt rows followed by its
    new keys or values and stores nothing (the per-row copy is recomputed in backward under
    :func:`~ngrpo_lightning.backends.recompute.recomputing`)."""

    def __init__(self, layer: DynamicLayer, rows: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.rows = layer.keys, layer.values, rows
        self.dtype, self.device, self.is_initialized = layer.keys.dtype, layer.keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return rows_then_new(self.keys, self.rows, key_states), rows_then_new(self.values, self.rows, value_states)


def _read_only_prefix(cache, inverse: torch.Tensor):
    """``cache`` (the distinct prompts' keys and values), each layer a :class:`SharedPrefixLayer` for ``inverse``."""
    cache.layers = [SharedPrefixLayer(layer, inverse) for layer in cache.layers]
    return cache
