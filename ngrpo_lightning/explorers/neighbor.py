"""N-GRPO neighbor mixing: mix the anchor's embedding with its nearest neighbors'.

Per row and per step (the paper's rule; docs/explorers.md):

1. gate ``m ~ Bernoulli(rho)``;
2. ``m = 0``: a plain sampling step (exactly :class:`TemperatureExplorer`'s);
3. ``m = 1``: anchor ``v* = argmax z~`` (``z~ = logits / T``); set ``C = [v*] + the k-1 tokens nearest to v*
   in E``; weights ``softmax(z~[C])``; next input ``sum_c w_c E[c]``; the emitted token (the text) is ``v*``.

The released code's (ZJUSCL/N-GRPO) differences are options: ``emit="sampled"``, ``gate="entropy"``, and weights from
the warped (top-k / top-p) probabilities renormalised over the set (``softmax(z~[C])`` without warping). The neighbor
index (:mod:`.neighbor_index`) is built at the first rollout and kept static unless ``refresh_every``."""

from __future__ import annotations

import torch

from ngrpo_lightning.explorers.base import (
    ExplorerStep,
    check_answer_start,
    check_choice,
    check_range,
    register_explorer,
)
from ngrpo_lightning.explorers.neighbor_index import METRICS, NeighborIndex
from ngrpo_lightning.explorers.temperature import TemperatureExplorer

EMIT = ("anchor", "sampled")  # the text of a mixed step: the paper's anchor, or the release's sampled token
GATES = ("rate", "entropy")


@register_explorer("neighbor")
class NeighborMixingExplorer(TemperatureExplorer):
    """Neighbor mixing (N-GRPO).

    Args:
        k: size of the mixed set, the anchor included (paper: 3; the release's ``mix_top_k``: 2 or 3).
        rho: probability that a row's step is mixed (paper: 0.1; 1.0 = "w/o rate" ablation).
        metric: neighbor metric, ``cosine`` (paper), ``dot``, ``l2`` or ``l1``.
        emit: the text of a mixed step: ``anchor`` (paper) or ``sampled`` (release: the sampler's token).
        gate: ``rate`` (Bernoulli(rho) per row and step) or ``entropy`` (mix when the warped
            distribution's entropy is >= ``entropy_threshold`` nats, the release's rule).
        entropy_threshold: the entropy gate's threshold (nats).
        answer_start: no mixing once a sequence has emitted this text (release: ``"</think>"``; see
            :class:`~ngrpo_lightning.explorers.base.Explorer`).
        temperature, top_k, top_p, min_p: the unmixed steps' sampling (:class:`TemperatureExplorer`);
            the mixture weights use the same temperature (weights at T=1 for T=0) and filters.
        exclude_special: never use the tokenizer's special tokens as neighbors.
        exclude_ids: further token ids never used as neighbors.
        refresh_every: rebuild the index every N rollouts as E trains (0 = static, as in the paper).
        precompute: fill the neighbor table for the whole vocabulary at once (V x V work) rather
            than lazily; always on a GPU, where a full table lets a step run without the host.
        chunk_size: vocabulary columns per similarity block of the search.
    """

    def __init__(
        self,
        k: int = 3,
        rho: float = 0.1,
        metric: str = "cosine",
        emit: str = "anchor",
        gate: str = "rate",
        entropy_threshold: float = 1.0,
        answer_start: str | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        exclude_special: bool = True,
        exclude_ids=(),
        refresh_every: int = 0,
        precompute: bool = False,
        chunk_size: int = 16384,
    ):
        super().__init__(temperature, top_k, top_p, min_p)  # the unmixed steps' sampling
        check_range("k", k, 1, integer=True)
        check_range("rho", rho, 0.0, 1.0)
        check_choice("metric", metric, METRICS)
        self.emit, self.gate = check_choice("emit", emit, EMIT), check_choice("gate", gate, GATES)
        self.entropy_threshold = float(check_range("entropy_threshold", entropy_threshold, 0.0))
        self.answer_start = check_answer_start(answer_start)
        check_range("refresh_every", refresh_every, 0, integer=True)
        check_range("chunk_size", chunk_size, 1, integer=True)
        self.k, self.rho, self.metric = int(k), float(rho), metric
        self.exclude_special, self.exclude_ids = bool(exclude_special), tuple(int(i) for i in exclude_ids)
        self.refresh_every, self.precompute, self.chunk_size = int(refresh_every), bool(precompute), int(chunk_size)
        self._index: NeighborIndex | None = None
        self._index_key = None
        self._prepare_calls = 0

    # ------------------------------------------------------------------ index
    def prepare(self, embeddings: torch.Tensor) -> None:
        super().prepare(embeddings)
        self._prepare_calls += 1
        excluded = set(self.exclude_ids) | (set(self._special_ids) if self.exclude_special else set())
        key = (tuple(sorted(excluded)), tuple(embeddings.shape), embeddings.device, embeddings.dtype)
        due = self.refresh_every and (self._prepare_calls - 1) % self.refresh_every == 0
        if self._index is None or key != self._index_key or due:
            self._index, self._index_key = self.build_index(embeddings, excluded), key

    def build_index(self, embeddings: torch.Tensor, excluded: set[int]) -> NeighborIndex:
        vocab = embeddings.shape[0]
        bad = [i for i in self.exclude_ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"explorer.exclude_ids contains {bad[0]}, not a token id: allowed [0, {vocab - 1}]")
        check_range("k", self.k, 1, vocab - len(excluded))  # enough candidates for every anchor
        index = NeighborIndex(embeddings, self.k - 1, self.metric, excluded, chunk_size=self.chunk_size)
        if self.precompute or embeddings.device.type != "cpu":  # a full table: a step looks up without the host
            index.precompute()
        return index

    @property
    def sync_free(self) -> bool:
        """True with a full neighbor table (always on a GPU); a lazy one checks which anchors are new."""
        return self._index is not None and self._index.complete

    capturable = sync_free  # with a full table a step is the same lookups every time: recorded on a GPU

    @property
    def index(self) -> NeighborIndex:
        if self._index is None:
            raise RuntimeError("NeighborMixingExplorer.prepare(embeddings) must be called before the first step")
        return self._index

    # ------------------------------------------------------------------- step
    def step(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> ExplorerStep:
        if self.gate == "rate" and self.rho == 0.0:
            return super().step(logits, generator)  # identical to plain sampling, RNG included
        b, device = logits.shape[0], logits.device
        warped = None  # the warped logits z~ (temperature, filters): of every row only for the entropy gate
        if self.gate == "entropy":
            warped = self.warp(logits)
            mixed = torch.special.entr(warped.softmax(-1)).sum(-1) >= self.entropy_threshold
            tokens = self.sample(logits, generator)
        elif self.rho == 1.0 and self.emit == "anchor":  # every row mixed and emits its anchor: nothing to sample
            mixed, tokens = torch.ones(b, dtype=torch.bool, device=device), logits.argmax(-1)
        else:
            mixed = torch.rand(b, generator=generator, device=device) < self.rho
            tokens = self.sample(logits, generator)
        if self.index.complete:  # every row's set, the mixed rows' kept: the step never waits for the host
            anchor, ids, weights = self.members(logits, warped)
            if self.emit == "anchor":
                tokens = torch.where(mixed, anchor, tokens)
            ids = torch.where(mixed[:, None], ids, tokens[:, None])  # unmixed rows: ignored by the engine
            weights = torch.where(mixed[:, None], weights, 1.0 / self.k)
            return ExplorerStep(tokens=tokens, mixed=mixed, ids=ids, weights=weights)
        # a lazily filled index (the CPU's): only the mixed rows' anchors are looked up
        rows = mixed.nonzero().squeeze(-1)
        ids = tokens[:, None].repeat(1, self.k)  # unmixed rows: ignored by the engine
        weights = torch.full(ids.shape, 1.0 / self.k, device=device)
        if rows.numel():
            anchor, ids[rows], weights[rows] = self.members(logits[rows], None if warped is None else warped[rows])
            if self.emit == "anchor":
                tokens[rows] = anchor  # a mixed row emits its anchor
        return ExplorerStep(tokens=tokens, mixed=mixed, ids=ids, weights=weights)

    def members(self, logits: torch.Tensor, warped: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The anchors ``argmax z~`` (first maximum on ties), the mixed sets (anchor, then neighbors, nearest first)
        and their weights (the warped probabilities renormalised over the set)."""
        anchor = logits.argmax(-1)
        ids = anchor[:, None]
        if self.k > 1:
            ids = torch.cat([ids, self.index.query(anchor).to(ids.device)], 1)
        warped = warped if warped is not None else self.warp(logits)
        return anchor, ids, warped.gather(-1, ids).softmax(-1)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"prepare_calls": self._prepare_calls}

    def load_state_dict(self, state: dict) -> None:
        self._prepare_calls = int(state.get("prepare_calls", 0))
        self._index = None  # rebuilt from the current E at the next rollout
