"""How the training module computes response log-probs: each pass cut to its rows' longest sequence, through the
FSDP2 root when sharded, the LM head in the backend's chunks, a group's prompt once, frozen passes on packed weights.
A mixin of :class:`~ngrpo_lightning.training.module.RLModule`."""

from __future__ import annotations

import math

import torch

from ngrpo_lightning.backends import file_weights
from ngrpo_lightning.backends.passes import packed_for_pass
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.rollout.padding import pad_to
from ngrpo_lightning.training.forward import response_logprobs
from ngrpo_lightning.training.parallel import decoder_layers


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s decoder layers, or none where they are not where transformers keeps them."""
    try:
        return decoder_layers(model)
    except ValueError:
        return []


def layers_checkpointed(model: torch.nn.Module) -> bool:
    """Whether ``model``'s decoder layers recompute in backward (gradient checkpointing), read from the layers
    (``is_gradient_checkpointing`` walks every module, thousands in a peft model)."""
    flags = [getattr(layer, "gradient_checkpointing", None) for layer in _layers(model)] or [None]
    if None in flags:
        return bool(getattr(model, "is_gradient_checkpointing", False))
    return any(flags)


def shared_prompt_tokens(batch: RolloutBatch) -> int:
    """The prompt tokens sharing saves on ``batch``, from its shape: every row but one per group, at the prompts'
    width (at most: a micro-batch mixing groups shares less)."""
    rows = len(batch)
    return (rows - math.ceil(rows / max(1, batch.group_size))) * batch.prompt_ids.shape[1]


def layer_params(model: torch.nn.Module) -> int:
    """The parameters of one of ``model``'s decoder layers (0 where they are not found)."""
    layers = _layers(model)
    return sum(p.numel() for p in layers[0].parameters()) if layers else 0


class LogprobPasses:
    """The log-prob passes of :class:`~ngrpo_lightning.training.module.RLModule`."""

    def _logprobs(self, model: torch.nn.Module, batch: RolloutBatch, temperature: float, **kwargs):
        """Response log-probs (and entropies) of ``batch`` under ``model``, on the batch cut to its longest sequence
        and padded back; the LM head in ``logprob_chunk_size`` chunks, a group's prompt once (``share_prompts``)."""
        width = batch.response_ids.shape[1]
        forward = self.sharded_root(model)
        trimmed = batch.trim()
        kwargs.setdefault("chunk_size", self.backend.logprob_chunk_size)
        kwargs.setdefault("keep_softmax_mib", self.backend.keep_softmax_mib)
        share = self._shares_prompts(model) and self.backend.shares_prompts(
            shared_prompt_tokens(trimmed), layer_params(model)
        )
        if self.plan.agree is not None:  # several processes: see _agreed_sharing
            share = self._agreed_sharing(share)
        kwargs["share_prompts"] = share
        if torch.is_grad_enabled():  # a training forward: the decoder's freed temporaries handed back before the head
            kwargs.setdefault("before_head", self.backend.release_memory)
        if forward is not None:  # FSDP's root forward: one pass of the sharded decoder
            logp, entropy = forward(trimmed, temperature, **kwargs)
        else:
            logp, entropy = response_logprobs(model, trimmed, temperature, **kwargs)
        return pad_to(logp, width), None if entropy is None else pad_to(entropy, width)

    def _agreed_sharing(self, share: bool) -> bool | str:
        """Several processes: a sharing pass calls the decoder twice and every rank must enter FSDP2's collectives as
        often, so a pass shares only where every rank's would (``plan.agree``), then always (``"always"``)."""
        return "always" if self.plan.agree(int(not share)) == 0 else False

    def _shares_prompts(self, model: torch.nn.Module) -> bool:
        """The backend's ``share_prompts``, unless ``model`` recomputes its layers in backward (a recomputed layer
        would extend the shared prompt cache twice)."""
        checkpointed = layers_checkpointed(model) or (
            model is self.policy and self.parallel is not None and self.parallel.activation_checkpointing
        )
        return self.backend.share_prompts and not checkpointed

    def _policy_logprobs_no_grad(self, batch: RolloutBatch) -> torch.Tensor:
        return self._logprobs_no_grad(self.policy, batch)  # the same products as the update's forward

    def _packed(self, model: torch.nn.Module, batch: RolloutBatch):
        """A frozen pass on weights the backend packed (:func:`~ngrpo_lightning.backends.passes.packed_for_pass`)."""
        rows = self.optim.micro_batch_size or len(batch)
        return packed_for_pass(model, rows, release=file_weights.weight_releaser(model))

    def _logprobs_no_grad(self, model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
        """Response log-probs [N, L] of ``model``, computed one micro-batch at a time."""
        temperature = self.explorer.temperature or 1.0
        out = torch.zeros_like(batch.rollout_logprobs)
        for rows, _ in self.plan.micro_batches(batch, token_level=False):
            part = batch.select(rows) if len(rows) < len(batch) else batch
            out[rows.to(out.device)] = self._logprobs(model, part, temperature)[0]
        return out
