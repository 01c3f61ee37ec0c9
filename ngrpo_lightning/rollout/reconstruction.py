"""Rebuild the input embeddings a rollout actually saw, for the training forward.

One generic function for every explorer and every engine: start from ``E[input_ids]``
and overwrite the positions named in the :class:`InputRecords` with their mixtures.
Gradients flow through ``E`` (into the mixed rows too, unless ``detach_mixture``).
"""

from __future__ import annotations

import torch

from ngrpo_lightning.rollout.records import NO_NOISE, InputRecords, noise_vectors


def mixture_embeddings(embedding: torch.Tensor, records: InputRecords) -> torch.Tensor:
    """The M mixed input vectors ``sum_j w_j E[ids_j] + scale * noise(seed)`` ([M, d])."""
    weights = records.weights.to(device=embedding.device, dtype=torch.float32)
    mix = torch.einsum("mk,mkd->md", weights, embedding[records.ids.to(embedding.device)].float())
    noisy = records.noise_seed != NO_NOISE
    if noisy.any():
        noise = torch.zeros_like(mix)
        noise[noisy.to(mix.device)] = noise_vectors(records.noise_seed[noisy].cpu(), mix.shape[-1]).to(mix.device)
        mix = mix + records.noise_scale.to(mix.device, torch.float32)[:, None] * noise
    return mix.to(embedding.dtype)


def build_inputs_embeds(
    embedding: torch.Tensor,
    input_ids: torch.Tensor,
    records: InputRecords | None,
    response_offset: int,
    detach_mixture: bool = False,
) -> torch.Tensor:
    """Input embeddings [B, T, d] for ``input_ids`` with the recorded mixtures in place.

    Args:
        embedding: the policy's input embedding matrix E (V x d), e.g.
            ``model.get_input_embeddings().weight``.
        input_ids: B x T token ids: left-padded prompt, then the response.
        records: the rollout's non-discrete steps (``pos`` indexes the response).
        response_offset: column of ``input_ids`` where the response starts.
        detach_mixture: stop gradients into E through the mixed positions.
    """
    embeds = torch.nn.functional.embedding(input_ids, embedding)
    if records is None or len(records) == 0:
        return embeds
    mix = mixture_embeddings(embedding, records)
    if detach_mixture:
        mix = mix.detach()
    rows = records.row.to(input_ids.device)
    cols = records.pos.to(input_ids.device) + response_offset
    return embeds.index_put((rows, cols), mix)
