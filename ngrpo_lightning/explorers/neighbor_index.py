"""Exact nearest neighbors among the rows of an embedding matrix, without a V x V matrix.

N-GRPO mixes an anchor token with the k-1 tokens whose input embeddings are nearest to it. The search is exact but
chunked: ``chunk_size`` columns at a time with a running top-n, so memory is anchors x chunk. Results are cached per
anchor in a V x n table (-1 = not yet computed); :meth:`NeighborIndex.precompute` fills it for every token. Ranking:
cosine similarity, or the negated l2 / l1 distance. A token is never its own neighbor, excluded ids never are, and
ties go to the lowest id. The index keeps its own copy of ``E``, so its geometry is that of ``E`` when it was built.

On CPU a float32 pass over ``E`` is bound by memory bandwidth and rollouts mostly search one or two new anchors,
so cosine search runs in two exact stages. Stage 1 scores every column approximately (float16 keys for a few
anchors, float32 for more) with a bounded error (:func:`score_error`); every column within twice that bound of
the n-th best is a candidate, and stage 2 ranks the candidates in float64. The result is exact, ties included;
an anchor with more near-ties than candidate slots is ranked over all columns in float64."""

from __future__ import annotations

import math

import torch

METRICS = ("cosine", "dot", "l2", "l1")
CANDIDATE_SLACK = 16  # stage-1 candidate slots beyond the n neighbors (CPU cosine search)
HALF_ANCHORS = 4  # stage 1 in float16 up to this many anchors per block (above, float32 matmuls are faster)


def score_error(dim: int, half: bool) -> float:
    """Bound on |stage-1 score - true score| for unit vectors of ``dim`` components. Float32: the sum of ``dim``
    products (dim x 2^-24, doubled for margin). Float16 adds rounding both operands (2 x 2^-11 by Cauchy-Schwarz;
    subnormal components 2^-25 each) and the result (2^-11)."""
    single = (dim + 2) * 2**-23
    return single + 3 * 2**-11 + 2 * math.sqrt(dim) * 2**-25 if half else single


class NeighborIndex:
    """The ``num_neighbors`` nearest rows of ``embeddings`` to any given row.

    Args:
        embeddings: E (V x d); searched on its device.
        num_neighbors: n = k - 1 neighbors per anchor (0 is allowed: no search).
        metric: ``cosine`` (default), ``l2`` or ``l1``.
        exclude_ids: ids that are never returned as neighbors.
        chunk_size: vocabulary columns per similarity block.
        anchor_block: anchors per similarity block (memory ~ anchor_block x chunk_size).
    """

    def __init__(
        self,
        embeddings: torch.Tensor,
        num_neighbors: int,
        metric: str = "cosine",
        exclude_ids=(),
        chunk_size: int = 16384,
        anchor_block: int = 256,
    ):
        if metric not in METRICS:
            raise ValueError(f"metric={metric!r} is unknown: allowed {list(METRICS)}")
        emb = embeddings.detach()
        self.vocab_size, self.metric, self.num_neighbors = emb.shape[0], metric, int(num_neighbors)
        self.chunk_size, self.anchor_block = int(chunk_size), int(anchor_block)
        if metric == "cosine":
            self.keys = torch.nn.functional.normalize(emb.float(), dim=-1).to(emb.dtype)
        else:
            self.keys = emb.clone()  # a copy: the index must not follow E as it trains
        self.sq_norms = self.keys.float().pow(2).sum(-1) if metric == "l2" else None
        self.excluded = torch.zeros(self.vocab_size, dtype=torch.bool, device=emb.device)
        ids = torch.as_tensor(list(exclude_ids), dtype=torch.long)
        self.excluded[ids.to(emb.device)] = True
        self.excluded_ids = self.excluded.nonzero().squeeze(-1)  # a few special tokens: filled by column
        self.table = torch.full((self.vocab_size, self.num_neighbors), -1, dtype=torch.long, device=emb.device)
        # the CPU cosine search runs in two stages (see the module docstring); other devices in one
        self.two_stage = metric == "cosine" and emb.device.type == "cpu"
        self.half_keys = self.keys.half() if self.two_stage else None
        self._complete = False

    # ---------------------------------------------------------------- public
    @property
    def complete(self) -> bool:
        """Whether every id's neighbors are in the table (after :meth:`precompute`): queries are lookups."""
        return self._complete

    def query(self, anchors: torch.Tensor) -> torch.Tensor:
        """Neighbors [B, n] of ``anchors`` [B], nearest first; searched once per distinct id."""
        anchors = anchors.to(self.table.device)
        found = self.table[anchors]
        if self.num_neighbors == 0 or self._complete:
            return found
        missing = found[:, 0] < 0
        if bool(missing.any()):
            new = anchors[missing].unique()
            self.table[new] = self.search(new)
            found = self.table[anchors]
        return found

    def precompute(self) -> None:
        """Fill the whole table now (V x V work; on a GPU about 2**26 similarities per block)."""
        if self.num_neighbors:
            todo = (self.table[:, 0] < 0).nonzero().squeeze(-1)
            block = (
                self.anchor_block
                if self.table.device.type == "cpu"
                else max(self.anchor_block, 2**26 // self.chunk_size)
            )
            self.table[todo] = self.search(todo, block)
        self._complete = True

    def search(self, anchors: torch.Tensor, anchor_block: int | None = None) -> torch.Tensor:
        """Exact neighbors [B, n] of ``anchors`` [B], bypassing the cache (``anchor_block``: default the index's)."""
        if self.num_neighbors == 0:
            return self.table[anchors]
        search, size = (
            self._search_two_stage if self.two_stage else self._search_block,
            anchor_block or self.anchor_block,
        )
        out = [search(anchors[i : i + size]) for i in range(0, len(anchors), size)]
        return torch.cat(out) if out else self.table[:0]

    # -------------------------------------------------------------- internals
    def _scores(self, query: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Similarity (higher = nearer) of query rows to vocabulary rows [start, stop)."""
        keys = self.keys[start:stop]
        if self.metric in ("cosine", "dot"):  # cosine: keys and queries are unit rows
            return (query @ keys.T).float()
        if self.metric == "l2":  # -(|q|^2 - 2 q.k + |k|^2); |q|^2 is constant per row, so dropped
            return 2 * (query @ keys.T).float() - self.sq_norms[start:stop][None]
        return -torch.cdist(query.float(), keys.float(), p=1)

    def _exact_scores(self, query: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Float64 cosine (the CPU ranking): one sum per column (identical columns tie), 2**21 products at a time."""
        step = max(1, 2**21 // (len(query) * query.shape[1]))
        q = query.double()[:, None, :]
        parts = [(q * self.keys[i : min(i + step, stop)].double()[None]).sum(-1) for i in range(start, stop, step)]
        return torch.cat(parts, 1)

    def _search_block(self, anchors: torch.Tensor, scores=None) -> torch.Tensor:
        """Exact neighbors of a block of anchors, columns scored by ``scores`` (default :meth:`_scores`)."""
        n, rows = self.num_neighbors, torch.arange(len(anchors), device=anchors.device)
        scores = scores or self._scores
        query = self.keys[anchors]
        best_s = torch.empty(len(anchors), 0, device=anchors.device)
        best_i = torch.empty(len(anchors), 0, dtype=torch.long, device=anchors.device)
        for start in range(0, self.vocab_size, self.chunk_size):
            stop = min(start + self.chunk_size, self.vocab_size)
            s = self._mask(scores(query, start, stop), anchors, rows, start, stop)
            vals, idx = _top_lowest_index(s, min(n, stop - start))
            best_s, best_i = _merge(torch.cat([best_s.to(vals.dtype), vals], 1), torch.cat([best_i, idx + start], 1), n)
        return best_i

    def _mask(self, s: torch.Tensor, anchors, rows, start: int, stop: int) -> torch.Tensor:
        """Scores with excluded columns and each anchor's own column set to -inf."""
        ids = self.excluded_ids
        s = s.index_fill_(1, ids[(ids >= start) & (ids < stop)] - start, float("-inf"))  # not a mask of every score
        own = (anchors >= start) & (anchors < stop)  # never the anchor itself
        s[rows[own], anchors[own] - start] = float("-inf")
        return s

    def _search_two_stage(self, anchors: torch.Tensor) -> torch.Tensor:
        """Exact cosine neighbors on CPU: approximate candidates, float64 ranking (module docstring)."""
        n, m, rows = self.num_neighbors, self.num_neighbors + CANDIDATE_SLACK, torch.arange(len(anchors))
        half = len(anchors) <= HALF_ANCHORS
        keys = self.half_keys if half else self.keys
        query = keys[anchors].float() if not half else keys[anchors]
        best_s, best_i = torch.empty(len(anchors), 0), torch.empty(len(anchors), 0, dtype=torch.long)
        for start in range(0, self.vocab_size, self.chunk_size):  # stage 1: the m best approximate scores
            stop = min(start + self.chunk_size, self.vocab_size)
            s = self._mask((query @ keys[start:stop].to(query.dtype).T).float(), anchors, rows, start, stop)
            vals, idx = s.topk(min(m, stop - start), dim=-1)
            best_s, best_i = torch.cat([best_s, vals], 1), torch.cat([best_i, idx + start], 1)
            if best_s.shape[1] > m:
                best_s, order = best_s.topk(m, dim=-1)
                best_i = best_i.gather(1, order)
        cut = best_s.topk(n, dim=-1).values[:, -1:]
        candidate = best_s >= cut - 2 * score_error(self.keys.shape[1], half)  # all that could reach the n-th score
        full = (candidate.sum(-1) == best_s.shape[1]) & (best_s.shape[1] == m)  # maybe more than m: rank all columns
        best_i, order = best_i.sort(dim=-1)  # by id, so that ties go to the lowest id below
        candidate = candidate.gather(1, order)
        exact = (self.keys[anchors].double()[:, None, :] * self.keys[best_i].double()).sum(-1)  # stage 2
        vals, top = _top_lowest_index(exact.masked_fill_(~candidate, float("-inf")), n)
        _, out = _merge(vals, best_i.gather(1, top), n)
        if bool(full.any()):
            out[full] = self._search_block(anchors[full], self._exact_scores)
        return out


def _top_lowest_index(scores: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-n per row, ties at the cut broken by the lowest column (topk's order is unspecified)."""
    vals, idx = scores.topk(n, dim=-1)
    tied = (scores >= vals[:, -1:]).sum(-1) > n  # more candidates than slots at the cut value
    if bool(tied.any()):  # rare (duplicate rows): redo those rows with a stable sort
        v, i = scores[tied].sort(dim=-1, descending=True, stable=True)
        vals[tied], idx[tied] = v[:, :n], i[:, :n]
    return vals, idx


def _merge(scores: torch.Tensor, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best n of the candidates: score descending, then id ascending."""
    by_id = ids.argsort(dim=-1, stable=True)
    scores, ids = scores.gather(1, by_id), ids.gather(1, by_id)
    order = scores.argsort(dim=-1, descending=True, stable=True)[:, :n]
    return scores.gather(1, order), ids.gather(1, order)
