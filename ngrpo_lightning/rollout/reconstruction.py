"""Rebuild the input embeddings a rollout actually saw, for the training forward.

One function for every explorer and engine: ``E[input_ids]`` with the positions named in the :class:`InputRecords`
overwritten by their mixtures. Gradients flow through ``E`` (into the mixed rows too, unless ``detach_mixture``).
"""

from __future__ import annotations

import torch

from ngrpo_lightning.rollout.records import NO_NOISE, ComponentHashes, InputRecords, noise_vectors


def mixture_vectors(
    embedding: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    noise_seed: torch.Tensor | None = None,
    noise_scale: torch.Tensor | None = None,
    hashes: ComponentHashes | None = None,
) -> torch.Tensor:
    """The mixed input vectors ``sum_j w_j E[ids_j] + scale * noise(seed)`` ([M, d]) of M rows, each depending on its
    row alone in the same order of operations whatever M is (decoding and training's rebuild get the same bits). A
    row whose seed is ``NO_NOISE`` gets no noise. ``hashes``: as :func:`~.records.noise_vectors`'s."""
    weights = weights.to(device=embedding.device, dtype=torch.float32)
    mix = (weights[..., None] * embedding[ids.to(embedding.device)].float()).sum(1)
    if noise_seed is not None:
        seed = noise_seed.to(mix.device)
        noise = noise_vectors(seed.clamp(min=0), mix.shape[-1], hashes)
        scale = noise_scale.to(mix.device, torch.float32)[:, None]
        mix = torch.where((seed != NO_NOISE)[:, None], mix + scale * noise, mix)
    return mix.to(embedding.dtype)


def mixture_embeddings(
    embedding: torch.Tensor, records: InputRecords, hashes: ComponentHashes | None = None
) -> torch.Tensor:
    """The M mixed input vectors of ``records`` ([M, d]): :func:`mixture_vectors` of its fields."""
    seed, scale = (records.noise_seed, records.noise_scale) if records.has_noise() else (None, None)
    return mixture_vectors(embedding, records.ids, records.weights, seed, scale, hashes)


def build_inputs_embeds(
    embedding: torch.Tensor,
    input_ids: torch.Tensor,
    records: InputRecords | None,
    response_offset: int,
    detach_mixture: bool = False,
) -> torch.Tensor:
    """Input embeddings [B, T, d] for ``input_ids`` with the recorded mixtures in place.

    Args:
        embedding: the policy's input embedding matrix E (V x d), e.g. ``model.get_input_embeddings().weight``.
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
