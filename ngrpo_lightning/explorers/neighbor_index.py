"""Exact nearest neighbors among the rows of an embedding matrix, without a V x V matrix.

N-GRPO mixes an anchor token with the k-1 tokens whose input embeddings are nearest to
it. The search is exact (brute force) but chunked: for a block of anchors, similarities
to the vocabulary are computed ``chunk_size`` columns at a time and a running top-n is
kept, so memory is (anchors x chunk), never V x V. Results are cached per anchor id in a
V x n table (-1 = not computed yet), so a token seen before costs one lookup; the table can
also be filled for every token at once (:meth:`NeighborIndex.precompute`).

Ranking: cosine similarity, or the negated l2 / l1 distance. A token is never its own
neighbor, and excluded ids (special tokens) are never neighbors. Ties go to the lowest
token id, so the result is a deterministic function of the matrix.

The index keeps its own copy of the matrix (normalized for cosine) in the matrix's dtype:
its geometry is that of ``E`` when the index was built, even if ``E`` trains afterwards.
"""

from __future__ import annotations

import torch

METRICS = ("cosine", "l2", "l1")


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

    def __init__(self, embeddings: torch.Tensor, num_neighbors: int, metric: str = "cosine", exclude_ids=(),
                 chunk_size: int = 16384, anchor_block: int = 256):
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
        self.table = torch.full((self.vocab_size, self.num_neighbors), -1, dtype=torch.long, device=emb.device)

    # ---------------------------------------------------------------- public
    def query(self, anchors: torch.Tensor) -> torch.Tensor:
        """Neighbors [B, n] of ``anchors`` [B], nearest first; searched once per distinct id."""
        anchors = anchors.to(self.table.device)
        found = self.table[anchors]
        if self.num_neighbors == 0:
            return found
        missing = found[:, 0] < 0
        if bool(missing.any()):
            new = anchors[missing].unique()
            self.table[new] = self.search(new)
            found = self.table[anchors]
        return found

    def precompute(self) -> None:
        """Fill the whole table now (V x V work in blocks; seconds on a GPU)."""
        if self.num_neighbors:
            todo = (self.table[:, 0] < 0).nonzero().squeeze(-1)
            self.table[todo] = self.search(todo)

    def search(self, anchors: torch.Tensor) -> torch.Tensor:
        """Exact neighbors [B, n] of ``anchors`` [B], bypassing the cache."""
        out = [self._search_block(anchors[i:i + self.anchor_block]) for i in range(0, len(anchors), self.anchor_block)]
        return torch.cat(out) if out else self.table[:0]

    # -------------------------------------------------------------- internals
    def _scores(self, query: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Similarity (higher = nearer) of query rows to vocabulary rows [start, stop)."""
        keys = self.keys[start:stop]
        if self.metric == "cosine":
            return (query @ keys.T).float()
        if self.metric == "l2":  # -(|q|^2 - 2 q.k + |k|^2); |q|^2 is constant per row, so dropped
            return 2 * (query @ keys.T).float() - self.sq_norms[start:stop][None]
        return -torch.cdist(query.float(), keys.float(), p=1)

    def _search_block(self, anchors: torch.Tensor) -> torch.Tensor:
        n, rows = self.num_neighbors, torch.arange(len(anchors), device=anchors.device)
        query = self.keys[anchors]
        best_s = torch.empty(len(anchors), 0, device=anchors.device)
        best_i = torch.empty(len(anchors), 0, dtype=torch.long, device=anchors.device)
        for start in range(0, self.vocab_size, self.chunk_size):
            stop = min(start + self.chunk_size, self.vocab_size)
            s = self._scores(query, start, stop).masked_fill_(self.excluded[start:stop][None], float("-inf"))
            own = (anchors >= start) & (anchors < stop)  # never the anchor itself
            s[rows[own], anchors[own] - start] = float("-inf")
            vals, idx = _top_lowest_index(s, min(n, stop - start))
            best_s, best_i = _merge(torch.cat([best_s, vals], 1), torch.cat([best_i, idx + start], 1), n)
        return best_i


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
