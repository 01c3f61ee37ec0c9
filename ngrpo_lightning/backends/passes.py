"""A pass over weights that do not change: a rollout, the frozen reference's log-probs.

Inside :func:`packed_for_pass` the layers the backend chose to pack multiply by one copy of their weights packed when
the pass starts (:mod:`.packing`), LoRA layers by one merged copy (:mod:`.lora`), dropped when it ends.
"""

from __future__ import annotations

import contextlib

import torch

from ngrpo_lightning.backends.joined import JoinedProjections
from ngrpo_lightning.backends.lora import LeanLoraLinear
from ngrpo_lightning.backends.packing import BackendLinear, pack
from ngrpo_lightning.models.walks import modules_of


@contextlib.contextmanager
def packed_for_pass(model: torch.nn.Module, rows: int, release=None, decoding: bool = False, keep: bool = False):
    """Within the block, ``model``'s :class:`BackendLinear` layers chosen to pack for this kind of pass (``pack_once``
    decoding, ``pack_frozen`` otherwise) multiply by a copy of their weights packed now. No backward may run inside.

    Args:
        rows: the usual rows of a product (the decoding batch), a hint for the layout.
        release: ``release(layer)``, called once a layer's weight is packed (a file-backed model frees the plain copy).
        decoding: a rollout: LoRA layers multiply by a merged copy (:mod:`.lora`), the LM head packs where chosen, and
            a :class:`~.joined.JoinedProjections` module multiplies its projections as one product.
        keep: a rollout replayed from graphs: the copies keep their storage for the next pass, rewritten in place.

    Yields the number of layers that multiply by a copy."""
    layers = []

    def start(m: torch.nn.Module):
        """Start ``m``'s pass; returns the children its pass leaves uncalled (not walked into)."""
        if decoding and isinstance(m, JoinedProjections):
            if m.start_merged_pass(rows, keep=keep):  # its projections are not called meanwhile
                layers.append(m)
                return m.projections()
        elif decoding and isinstance(m, LeanLoraLinear):
            if m.start_merged_pass(rows, keep=keep):  # False where it cannot run merged
                layers.append(m)
                return (m.base_layer,)  # not called meanwhile (the adapter matrices are plain layers)
        elif isinstance(m, BackendLinear) and (m.pack_per_product or (m.pack_once if decoding else m.pack_frozen)):
            m._in_pass = True  # (a layer that packs nothing is left as it is)
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
