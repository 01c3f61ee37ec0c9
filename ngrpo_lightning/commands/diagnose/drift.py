"""The semantic-drift pilot: where do perturbed input embeddings land?

N-GRPO's motivation (the paper's Figure 1): isotropic Gaussian noise pushes an input embedding off
the vocabulary's "semantic manifold", neighbor mixing keeps it on. Measured without a model forward:

* **Gaussian**: ``e + r * u``, ``u`` a uniformly random unit direction, ``r = s * ||e||`` for each
  scale ``s`` (the norm fixed exactly, so the matched-norm comparison is exact).
* **Neighbor mixing**: the explorer's mixture ``sum_j w_j E[c_j]`` over the anchor and its k-1
  nearest tokens, ``w`` drawn from a pool (:func:`draw_weights`): the weights the explorer recorded
  in rollouts (``weights=explorer``) or uniform ``1/k`` (``weights=uniform``, the largest displacement).
* **Gaussian at matched norms**: per mixed vector, Gaussian noise of norm ``||mix - e||``.

Each perturbed vector is decoded to its nearest non-special token by cosine; metrics per method and
scale: :func:`drift_metrics` and examples."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ngrpo_lightning.explorers.neighbor_index import NeighborIndex

# The default pilot set: what a math rollout is made of; strings that are not one token are skipped.
DIGITS = tuple(str(i) for i in range(10))
OPERATORS = ("+", "-", "*", "/", "=", "^", "<", ">", "(", ")", "%", "!", ".", ",")
MATH_SYMBOLS = ("π", "×", "±", "÷", "√", "≤", "≥", "≠", "∞", "\\", "{", "}", " x", " y", " n", " sqrt", " frac")
FUNCTION_WORDS = (
    " the",
    " of",
    " and",
    " to",
    " is",
    " in",
    " a",
    " that",
    " for",
    " it",
    " with",
    " as",
    " be",
    " on",
    " not",
    " this",
    " are",
    " by",
    " if",
    " then",
    " so",
    " we",
    " or",
    " from",
)
DEFAULT_TOKENS = DIGITS + OPERATORS + MATH_SYMBOLS + FUNCTION_WORDS


# ------------------------------------------------------------------ tokens
def token_id(tokenizer, text: str) -> int | None:
    """The id of ``text`` as one token: what it encodes to, else an exact vocabulary entry (``"Ġthe"``), else
    ``None``. Encoding comes first: in a byte-level vocabulary ``"×"`` is also the entry of the lone byte 0xD7."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1:
        return int(ids[0])
    return tokenizer.get_vocab().get(text)


def select_tokens(
    tokenizer, tokens: Sequence | None = None, exclude_ids: Sequence[int] = ()
) -> tuple[list[int], list[str]]:
    """``(ids, labels)`` of the pilot tokens. ``tokens=None``: the :data:`DEFAULT_TOKENS` that are single tokens here;
    a user list must be all single, non-special tokens, the error naming every string that is not."""
    excluded = {int(i) for i in exclude_ids}
    ids, labels, missing, special = [], [], [], []
    for text in DEFAULT_TOKENS if tokens is None else [str(t) for t in tokens]:
        i = token_id(tokenizer, text)
        if i is None:
            missing.append(text)
        elif i in excluded:
            special.append(text)
        elif i not in ids:
            ids.append(i)
            labels.append(text)
    if tokens is not None and missing:
        raise ValueError(
            f"tokens: {missing} not in the vocabulary (each entry must be one token of the model's "
            f"tokenizer, e.g. '+', '7' or ' the')"
        )
    if tokens is not None and special:
        raise ValueError(f"tokens: {special} are special tokens, which mixing never uses: drop them")
    if not ids:
        raise ValueError("tokens: none of the tokens is in the vocabulary")
    return ids, labels


# ------------------------------------------------------------ perturbations
def gaussian_perturb(
    vectors: torch.Tensor, radius: torch.Tensor | float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``v + r * u`` per row, ``u`` uniform on the unit sphere (normalized ``N(0, I)``)."""
    noise = torch.randn(vectors.shape, generator=generator, device=vectors.device, dtype=torch.float32)
    unit = noise / noise.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    radius = torch.as_tensor(radius, dtype=torch.float32, device=vectors.device)
    return vectors.float() + (radius[..., None] if radius.ndim else radius) * unit


def mix(embeddings: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The explorer's mixture ``sum_j w_j E[ids_j]`` ([N, k] ids and weights -> [N, d])."""
    return torch.einsum("nk,nkd->nd", weights.float(), embeddings[ids].float())


def draw_weights(pool: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` weight vectors drawn uniformly, with replacement, from ``pool`` ([M, k])."""
    if pool.ndim != 2 or not len(pool):
        raise ValueError(f"the weight pool must be a non-empty [M, k] tensor, got shape {tuple(pool.shape)}")
    return pool[torch.randint(len(pool), (n,), generator=generator)]


# ------------------------------------------------------------------ decoding
class Decoder:
    """Nearest token by cosine over the rows of ``E`` not in ``exclude_ids``: exact, chunked over the
    vocabulary, ties to the lowest id (as :class:`NeighborIndex`). A call returns ids; :meth:`nearest` also cosines."""

    def __init__(self, embeddings: torch.Tensor, exclude_ids: Sequence[int] = (), chunk_size: int = 16384):
        self.keys = torch.nn.functional.normalize(embeddings.detach().float(), dim=-1)
        self.excluded_ids = torch.as_tensor(sorted(set(exclude_ids)), dtype=torch.long)  # a few special tokens
        self.chunk_size = int(chunk_size)

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        return self.nearest(vectors)[0]

    def nearest(self, vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, cosines)`` of the nearest tokens of ``vectors`` [N, d]."""
        query = torch.nn.functional.normalize(vectors.float(), dim=-1)
        best = torch.full((len(query),), float("-inf"))
        best_id = torch.zeros(len(query), dtype=torch.long)
        for start in range(0, len(self.keys), self.chunk_size):
            stop = min(start + self.chunk_size, len(self.keys))
            ids = self.excluded_ids[(self.excluded_ids >= start) & (self.excluded_ids < stop)] - start
            scores = (query @ self.keys[start:stop].T).index_fill_(1, ids, float("-inf"))  # by column
            val, idx = scores.max(-1)  # the first maximum within the chunk
            better = val > best  # strict: an earlier (lower-id) chunk keeps ties
            best, best_id = torch.where(better, val, best), torch.where(better, idx + start, best_id)
        return best_id, best


# ------------------------------------------------------------------- metrics
def drift_metrics(
    anchors: torch.Tensor,
    originals: torch.Tensor,
    perturbed: torch.Tensor,
    decoded: torch.Tensor,
    neighborhoods: torch.Tensor,
    nearest_cosine: torch.Tensor | None = None,
) -> dict[str, float]:
    """Metrics of N perturbations of ``anchors`` [N] (embeddings ``originals`` [N, d]): ``same_frac``
    (decoded == anchor), ``neighborhood_frac`` (decoded in the anchor's row of ``neighborhoods``
    [N, k]), ``cosine`` (mean cosine to the original), ``rel_norm`` (mean ``||p - e|| / ||e||``) and,
    given the decoder's cosines, ``nearest_cosine`` (how close the vector stays to *some* token)."""
    originals, perturbed = originals.float(), perturbed.float()
    extra = {} if nearest_cosine is None else {"nearest_cosine": float(nearest_cosine.float().mean())}
    return {
        "same_frac": float((decoded == anchors).float().mean()),
        "neighborhood_frac": float((decoded[:, None] == neighborhoods).any(-1).float().mean()),
        "cosine": float(torch.nn.functional.cosine_similarity(perturbed, originals, dim=-1).mean()),
        "rel_norm": float(((perturbed - originals).norm(dim=-1) / originals.norm(dim=-1).clamp(min=1e-12)).mean()),
        **extra,
    }


def examples(anchors: torch.Tensor, decoded: torch.Tensor, label: Callable[[int], str], limit: int = 5) -> list[str]:
    """Up to ``limit`` ``'anchor' -> 'decoded'`` changes: each anchor's most frequent first, then the rest."""
    counts: dict[tuple[int, int], int] = {}
    for a, d in zip(anchors.tolist(), decoded.tolist()):
        if a != d:
            counts[(a, d)] = counts.get((a, d), 0) + 1
    ranked = sorted(counts, key=lambda pair: (-counts[pair], pair))
    seen: set[int] = set()
    first = [p for p in ranked if p[0] not in seen and not seen.add(p[0])]
    chosen = first + [p for p in ranked if p not in first]
    return [f"{label(a)!r} -> {label(d)!r}" for a, d in chosen[:limit]]


# ------------------------------------------------------------------- the pilot
def run_drift(
    embeddings: torch.Tensor,
    token_ids: Sequence[int],
    weight_pool: torch.Tensor,
    scales: Sequence[float],
    n: int = 16,
    k: int = 3,
    metric: str = "cosine",
    exclude_ids: Sequence[int] = (),
    seed: int = 0,
    label: Callable[[int], str] = str,
    num_examples: int = 5,
) -> dict:
    """Perturb each token's embedding ``n`` times per method; decode; measure. Returns ``{"rows": [{method, scale,
    same_frac, neighborhood_frac, cosine, rel_norm, nearest_cosine, examples}], "points": {...}, "neighborhoods":
    {anchor: [k ids]}}``: rows ``gaussian`` (per scale), ``mixing`` (scale = mean relative displacement),
    ``gaussian_matched``; ``points``: one draw per token and method, for the PCA picture."""
    if not 1 <= k <= embeddings.shape[0] - len(set(exclude_ids)):
        raise ValueError(f"k={k} is out of range: allowed [1, {embeddings.shape[0] - len(set(exclude_ids))}]")
    if weight_pool.shape[-1] != k:
        raise ValueError(f"the weight pool has {weight_pool.shape[-1]} weights per mixture, expected k={k}")
    bad = [s for s in scales if s < 0]
    if bad:
        raise ValueError(f"scales must be >= 0, got {bad[0]}")
    if n < 1:
        raise ValueError(f"n (draws per token and method) must be >= 1, got {n}")
    gen = torch.Generator().manual_seed(seed)
    E = embeddings.detach().float().cpu()
    tokens = torch.as_tensor(list(token_ids), dtype=torch.long)
    index = NeighborIndex(E, k - 1, metric, exclude_ids)
    hood = torch.cat([tokens[:, None], index.query(tokens)], 1)  # [T, k]: the explorer's C per anchor
    anchors, hoods = tokens.repeat_interleave(n), hood.repeat_interleave(n, 0)  # n draws per token
    originals = E[anchors]
    norms = originals.norm(dim=-1)
    decode = Decoder(E, exclude_ids)
    rows, points = [], {"tokens": tokens.tolist(), "original": E[tokens]}

    def measure(method: str, scale: float, perturbed: torch.Tensor) -> None:
        decoded, cos = decode.nearest(perturbed)
        rows.append(
            {
                "method": method,
                "scale": scale,
                **drift_metrics(anchors, originals, perturbed, decoded, hoods, cos),
                "examples": examples(anchors, decoded, label, num_examples),
            }
        )
        points[f"{method}@{scale:g}" if method == "gaussian" else method] = perturbed[::n]  # the first draw per token

    for s in scales:
        measure("gaussian", float(s), gaussian_perturb(originals, s * norms, gen))
    mixed = mix(E, hoods, draw_weights(weight_pool.float().cpu(), len(anchors), gen))
    radius = (mixed - originals).norm(dim=-1)  # the displacement mixing made, draw by draw
    measure("mixing", float((radius / norms).mean()), mixed)
    measure("gaussian_matched", float((radius / norms).mean()), gaussian_perturb(originals, radius, gen))
    return {"rows": rows, "points": points, "neighborhoods": {int(t): h.tolist() for t, h in zip(tokens, hood)}}


def pca_2d(points: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Project ``points`` [N, d] on the top-2 principal axes of ``basis`` [M, d] (centered at its mean)."""
    center = basis.float().mean(0)
    _, _, v = torch.linalg.svd(basis.float() - center, full_matrices=False)
    return (points.float() - center) @ v[:2].T
