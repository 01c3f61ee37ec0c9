"""Side-by-side rollouts: the same prompts, the same G and the same seed, one explorer at a time.

Names are an ``experiment`` option (``grpo``, ``ngrpo``, ``stht``, ...) or an ``explorer`` option (``temperature``,
``neighbor``, ``gaussian``, ``gumbel``), each with the settings ``ngrpo train`` would use, changed only by
``explorer_args`` (``+explorer_args.ngrpo.rho=1.0``). Per explorer, over all groups of G responses to one prompt:

* ``mean@G`` (accuracy) and ``pass@G`` (at least one of the G is correct);
* ``distinct_answers``: distinct extracted final answers per group (no answer not counted);
* ``distinct_{1..4}gram``: distinct n-grams / n-grams of the group's responses (token ids);
* ``edit_distance``: mean token-level Levenshtein distance over response pairs (rapidfuzz), and
  ``edit_distance_norm``: divided by the longer response's length (0 = identical);
* ``length``: mean response length in tokens, ``truncated_frac``: responses cut at the limit,
  ``mixed_frac``: decoding steps whose next input was not a plain token embedding."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from omegaconf import OmegaConf

from ngrpo_lightning.config import ConfigError, compose, group_options
from ngrpo_lightning.metrics import distinct_ngrams, pairwise_edit_distance, pass_at_k
from ngrpo_lightning.rewards import score_responses


def explorer_choices() -> list[str]:
    """Valid explorer names: the experiment options and the explorer options (but ``custom``)."""
    return sorted((set(group_options("explorer")) - {"custom"}) | set(group_options("experiment")))


def resolve_explorers(names: Sequence[str], args: Mapping[str, Mapping] | None = None) -> list[tuple[str, dict]]:
    """``[(name, explorer config)]`` from the training configs with ``args[name]`` merged in; an unknown
    name raises :class:`~ngrpo_lightning.config.ConfigError` listing the valid ones."""

    if isinstance(names, str) or not names:
        raise ConfigError(f"explorers must be a non-empty list, e.g. explorers=[temperature,ngrpo], got {names!r}")
    names = [str(n) for n in names]
    valid = explorer_choices()
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ConfigError(f"explorers: unknown explorer {unknown[0]!r}: valid names are {valid}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"explorers: {twice[0]!r} is listed twice")
    args = dict(args or {})
    stray = sorted(set(args) - set(names))
    if stray:
        raise ConfigError(f"explorer_args.{stray[0]}: {stray[0]!r} is not in explorers={names}")
    out = []
    for name in names:
        group = "experiment" if name in group_options("experiment") else "explorer"
        cfg = compose([f"{group}={name}", "logger=none"])
        out.append((name, {**OmegaConf.to_container(cfg.explorer, resolve=True), **dict(args.get(name) or {})}))
    return out


def group_metrics(seqs: list[list[int]], correct: list[bool], answers: list) -> dict[str, float]:
    """The metrics of one group of G responses (token ids), their correctness and answers."""
    g = len(seqs)
    out = {
        f"mean@{g}": sum(correct) / g,
        f"pass@{g}": pass_at_k(g, int(sum(correct)), g),
        "distinct_answers": float(len({a for a in answers if a is not None})),
    }
    out.update({f"distinct_{n}gram": distinct_ngrams(seqs, n) for n in range(1, 5)})
    out["edit_distance"], out["edit_distance_norm"] = pairwise_edit_distance(seqs)
    out["length"] = sum(len(s) for s in seqs) / g
    return out


def explorer_rollouts(
    engine, items: list[dict], explorer, G: int, max_new_tokens: int, reward, batch_size: int = 8, progress=None
) -> dict:
    """Roll out every prompt of ``items`` G times with ``explorer`` and score it; returns
    ``{"metrics": {...}, "groups": [{id, answer, responses, answers, correct}]}``, metrics averaged
    over groups (``mixed_frac``, ``truncated_frac`` over responses)."""
    groups, per_group, tokens, mixed, truncated = [], [], 0, 0, 0
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        batch = engine.generate([it["prompt_ids"] for it in chunk], explorer, n=G, max_new_tokens=max_new_tokens)
        golds = [it["answer"] for it in chunk for _ in range(G)]
        scored = score_responses(
            reward, batch.response_text, golds, [it.get("verifier") for it in chunk for _ in range(G)]
        )
        answers = list(scored.answers) if scored.answers else [None] * len(batch)
        lengths = batch.response_lengths.tolist()
        seqs = [row[:n].tolist() for row, n in zip(batch.response_ids, lengths)]
        tokens, mixed = tokens + sum(lengths), mixed + len(batch.records)
        truncated += int(batch.truncated.sum()) if batch.truncated is not None else 0
        for i, it in enumerate(chunk):
            rows = slice(i * G, (i + 1) * G)
            correct = scored.correct[rows].tolist()
            per_group.append(group_metrics(seqs[rows], correct, answers[rows]))
            groups.append(
                {
                    "id": it["id"],
                    "answer": it["answer"],
                    "responses": batch.response_text[rows],
                    "answers": answers[rows],
                    "correct": correct,
                }
            )
        if progress is not None:
            progress(len(chunk))
    metrics = {key: sum(m[key] for m in per_group) / len(per_group) for key in per_group[0]}
    metrics["mixed_frac"] = mixed / max(tokens, 1)
    metrics["truncated_frac"] = truncated / max(len(groups) * G, 1)
    return {"metrics": metrics, "groups": groups}


def compare_explorers(
    engine_factory,
    items: list[dict],
    explorers: list[tuple[str, object]],
    G: int,
    max_new_tokens: int,
    reward,
    batch_size: int = 8,
    show_progress: bool = True,
) -> dict:
    """:func:`explorer_rollouts` for each ``(name, explorer)``, each on a fresh, equally seeded engine."""
    from tqdm.auto import tqdm

    out = {}
    with tqdm(total=len(items) * len(explorers), desc="rollouts", unit="prompt", disable=not show_progress) as bar:
        for name, explorer in explorers:
            bar.set_postfix_str(name)
            out[name] = explorer_rollouts(
                engine_factory(), items, explorer, G, max_new_tokens, reward, batch_size, progress=bar.update
            )
    return out


def mixture_weight_pool(engine, prompt_ids: list[list[int]], explorer, G: int, max_new_tokens: int) -> torch.Tensor:
    """The mixture weights ([M, k]) a ``NeighborMixingExplorer`` drew in rollouts of ``prompt_ids``."""
    batch = engine.generate(prompt_ids, explorer, n=G, max_new_tokens=max_new_tokens)
    if not len(batch.records):
        raise ValueError(
            f"the explorer mixed no step in {len(prompt_ids)} prompts x {G} rollouts of at most "
            f"{max_new_tokens} tokens: raise G, max_new_tokens or weight_prompts, or use weights=uniform"
        )
    return batch.records.weights.float().cpu()
