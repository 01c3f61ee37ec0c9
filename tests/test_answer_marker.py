"""AnswerMarker: a sequence stops being mixed at the step that completes its marker (matched
on token ids, several tokens allowed), whatever the rows' order between steps."""

import pytest
import torch

from ngrpo_lightning.explorers import ExplorerStep
from ngrpo_lightning.rollout.answer_marker import AnswerMarker


def step(tokens):
    n = len(tokens)
    return ExplorerStep(
        tokens=torch.tensor(tokens),
        mixed=torch.ones(n, dtype=torch.bool),
        ids=torch.zeros(n, 1).long(),
        weights=torch.ones(n, 1),
    )


def test_a_multi_token_marker_stops_mixing_from_its_last_token_on():
    marker = AnswerMarker([7, 8])
    # two sequences "a" and "b"; "b" emits 7, 8 at steps 1-2; "a" emits 7 then 9 (no match)
    history = {"a": [7, 9, 8, 7], "b": [5, 7, 8, 1]}
    mixed = {"a": [], "b": []}
    for t in range(4):
        keys = ["b", "a"] if t % 2 else ["a", "b"]  # rows swap between steps, as in vLLM
        s = step([history[k][t] for k in keys])
        marker.unmix(s, keys)
        for k, m in zip(keys, s.mixed.tolist()):
            mixed[k].append(m)
    assert mixed == {"a": [True, True, True, True], "b": [True, True, False, False]}


def test_tokens_that_do_not_count_are_not_matched():
    marker = AnswerMarker([7])
    s = step([7, 7])
    marker.unmix(s, [0, 1], emitted=torch.tensor([False, True]))  # row 0: a discarded partial-prefill token
    assert s.mixed.tolist() == [True, False]


def test_an_empty_marker_is_refused():
    with pytest.raises(ValueError, match="answer_start"):
        AnswerMarker([])
