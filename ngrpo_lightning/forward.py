"""The training forward: log-probs of a rollout's response tokens under a model.

The inputs are rebuilt from the rollout's tokens plus its records, so the log-probs are
computed on exactly the inputs the rollout saw (mixed steps included).
"""

from __future__ import annotations

import torch

from .rollout.batch import RolloutBatch
from .rollout.reconstruction import build_inputs_embeds


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens, as ``generate`` does for left padding."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of ``softmax(logits)`` ([..., V] -> [...])."""
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def response_logprobs(
    model: torch.nn.Module,
    batch: RolloutBatch,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    detach_mixture: bool = False,
    use_records: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N, L] of ``batch.response_ids`` (0 on padding) and, optionally, the
    per-token entropy [N, L] (detached, for metrics).

    ``use_records=False`` ignores the mixed steps (feeds ``E[token]`` everywhere): only
    useful as a negative control.
    """
    embedding = model.get_input_embeddings().weight
    input_ids = batch.input_ids
    mask = batch.attention_mask
    embeds = build_inputs_embeds(embedding, input_ids, batch.records if use_records else None, batch.response_offset, detach_mixture)
    length = batch.response_ids.shape[1]
    out = model(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False, logits_to_keep=length + 1)
    logits = out.logits[:, :-1].float() / (temperature or 1.0)  # position t predicts response token t
    logp = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    logp = logp * batch.response_mask
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = token_entropy(logits.detach())
    return logp, entropy
