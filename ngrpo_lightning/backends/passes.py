"""A pass over weights that do not change: a rollout, the frozen reference's log-probs.

Inside :func:`packed_for_pass`, the layers the backend chose to pack for such a pass multiply by one copy
of their weights packed when the pass starts (:mod:`.linear`), and LoRA layers by one merged copy
(:mod:`.lora`); the copies are dropped when it ends. Nothing here changes a module's forward: each
layer's class reads its copy.
"""

from __future__ import annotations

import contextlib

import torch

from ngrpo_lightning.backends.joined import JoinedProjections
from ngrpo_lightning.backends.linear import BackendLinear, pack
from ngrpo_lightning.backends.lora import LeanLoraLinear
from ngrpo_lightning.models.walks import modules_of


@contextlib.contextmanager
def packed_for_pass(model: torch.nn.Module, rows: int, release=None, decoding: bool = False, keep: bool = False):
    """Within the block, ``model``'s :class:`BackendLinear` layers chosen to pack for this kind of pass
    (``pack_once`` decoding, ``pack_frozen`` otherwise) multiply by a copy of their weights packed
    now, the others by their plain weights.

    ``rows``: the usual number of rows of a product (the decoding batch), a hint for the layout.
    Use it where the weights do not change and nothing needs a backward. ``decoding`` (a
    rollout): LoRA layers multiply once, by a merged copy ``W + scale B A`` (packed where their
    base layer packs), instead of three products per token (:mod:`.lora`), and the LM head packs
    too where chosen (a log-prob pass reads its weight directly, so only decoding calls it).
    ``release(layer)``, if given, is
    called once a layer's weight is packed: a frozen model whose weights are read back from a
    file for each pass frees the plain copy there, so the pass holds one copy of each weight,
    not two. A fused attention or gated MLP (:class:`~.joined.JoinedProjections`) multiplies its
    projections (queries, keys and values; gate and up) as one product in a rollout, on their
    joined weights in place or on one copy, LoRA's merged copies written into it.
    ``keep`` (a rollout whose step replays from graphs): these copies keep
    their storage for the next pass, rewritten in place, so the graphs' addresses hold. Yields the
    number of layers that multiply by a copy."""
    layers = []

    def start(m: torch.nn.Module):
        """Start ``m``'s pass; returns the children its pass leaves uncalled (not walked into)."""
        if decoding and isinstance(m, JoinedProjections):
            # one product: its projections (and LoRA's base layers) are not called meanwhile
            if m.start_merged_pass(rows, keep=keep):
                layers.append(m)
                return m.projections()
        elif decoding and isinstance(m, LeanLoraLinear):
            if m.start_merged_pass(rows, keep=keep):  # False where it cannot run merged
                layers.append(m)
                # its base layer is not called meanwhile (the adapter matrices are plain layers)
                return (m.base_layer,)
        elif isinstance(m, BackendLinear) and (m.pack_per_product or (m.pack_once if decoding else m.pack_frozen)):
            # (a layer that packs nothing multiplies as it always does: nothing to switch)
            m._in_pass = True
            layers.append(m)
            if m.pack_once if decoding else m.pack_frozen:
                m._pass_weight = pack(m.weight.detach(), rows)
                if release is not None:
                    release(m)
        return None

    try:
        modules_of(model, prune=start)  # one walk; what a merged product covers is left out of it
        yield sum(1 for m in layers if not isinstance(m, BackendLinear) or m._pass_weight is not None)
    finally:
        for m in layers:
            m.end_pass()
