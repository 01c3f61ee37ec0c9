"""Exploration metrics of a rollout batch: how often inputs were mixed, how spread mixtures were, group diversity."""

from __future__ import annotations

import itertools

import torch
from rapidfuzz.distance import Levenshtein

from ngrpo_lightning.rewards import extract_answer
from ngrpo_lightning.rollout.batch import RolloutBatch


def distinct_ngrams(sequences: list[list[int]], n: int) -> float:
    """Distinct n-grams / total n-grams over a group of token sequences (1.0 = no repeats)."""
    grams = [tuple(s[i : i + n]) for s in sequences for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def edit_distance(a, b) -> int:
    """Levenshtein distance (insert, delete, substitute: cost 1 each) between two token sequences."""
    return Levenshtein.distance(list(a), list(b))


def pairwise_edit_distance(sequences: list[list[int]]) -> tuple[float, float]:
    """Mean edit distance over the pairs of a group, in tokens and divided by the longer of each
    pair (0 = identical responses, 1 = nothing in common); (0, 0) for fewer than two."""
    pairs = list(itertools.combinations(sequences, 2))
    if not pairs:
        return 0.0, 0.0
    dists = [edit_distance(a, b) for a, b in pairs]
    norm = [d / max(len(a), len(b), 1) for d, (a, b) in zip(dists, pairs)]
    return sum(dists) / len(dists), sum(norm) / len(norm)


def mixture_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy of each mixture's weights ([M, K] -> [M]); 0 for a one-hot mixture."""
    w = weights.float().clamp(min=0)
    return -(w * torch.log(w.clamp(min=1e-12))).sum(-1)


def exploration_metrics(batch: RolloutBatch, answers: list | None = None) -> dict[str, float]:
    """``explore/*`` metrics: mixed-step fraction, mixture-weight entropy, and within groups distinct
    n-grams (n = 1..4), pairwise edit distance and distinct final answers. ``answers``: the rows'
    extracted answers (``RewardResult.answers``); else each response's last ``\\boxed{}``."""
    n_tokens = int(batch.response_mask.sum())
    out = {"explore/mixed_frac": len(batch.records) / max(n_tokens, 1)}
    out["explore/mixture_entropy"] = float(mixture_entropy(batch.records.weights).mean()) if len(batch.records) else 0.0
    lengths = batch.response_lengths.tolist()
    seqs = [row[:n].tolist() for row, n in zip(batch.response_ids, lengths)]
    g = batch.group_size
    groups = [seqs[i : i + g] for i in range(0, len(seqs), g)]
    for n in range(1, 5):
        out[f"explore/distinct_{n}gram"] = sum(distinct_ngrams(grp, n) for grp in groups) / max(len(groups), 1)
    out["explore/edit_distance_norm"] = sum(pairwise_edit_distance(grp)[1] for grp in groups) / max(len(groups), 1)
    if answers is None and batch.response_text:
        answers = [extract_answer(t) for t in batch.response_text]
    if answers:
        per_group = [answers[i : i + g] for i in range(0, len(answers), g)]
        out["explore/distinct_answers_frac"] = sum(len(set(a)) / len(a) for a in per_group) / max(len(per_group), 1)
    return out
