"""A user's explorer is tried on made-up logits before any model loads, as objectives are: what it
returns, its ids and its mixture weights are checked, and a mistake is one line naming the class
and the field (it used to surface after the model loaded and validation ran, in an ~80-line
traceback through Lightning; mixture weights that were raw logits trained silently)."""

import pytest
import torch

from ngrpo_lightning.build.components import build_explorer
from ngrpo_lightning.commands.cli import main
from ngrpo_lightning.config import ConfigError, compose
from ngrpo_lightning.explorers import EXPLORERS, Explorer, ExplorerStep, check_explorer


class ReturnsTokens(Explorer):
    def step(self, logits, generator=None):
        return logits.argmax(-1)  # a Tensor, not an ExplorerStep


class RawLogitWeights(Explorer):
    def step(self, logits, generator=None):
        top = logits.topk(3, dim=-1)
        mixed = torch.ones(len(logits), dtype=torch.bool)
        return ExplorerStep(tokens=top.indices[:, 0], mixed=mixed, ids=top.indices, weights=top.values)


class NegativeWeights(RawLogitWeights):
    def step(self, logits, generator=None):
        step = super().step(logits, generator)
        step.weights = torch.tensor([1.5, -0.25, -0.25]).expand_as(step.ids).clone()
        return step


class OutOfVocabulary(Explorer):
    def step(self, logits, generator=None):
        return ExplorerStep(tokens=torch.full((len(logits),), logits.shape[1]))


@pytest.mark.parametrize(
    "cls, message",
    [
        (ReturnsTokens, "ReturnsTokens.step returned a Tensor, not an ExplorerStep"),
        (RawLogitWeights, r"RawLogitWeights.step: `weights` of each mixed row must sum to 1"),
        (NegativeWeights, r"NegativeWeights.step: `weights` of the mixed rows must be non-negative"),
        (OutOfVocabulary, r"OutOfVocabulary.step: `tokens` must be ids in \[0, 1024\)"),
    ],
)
def test_a_mistaken_explorer_is_named_before_the_model_loads(cls, message):
    with pytest.raises(ValueError, match=message):
        check_explorer(cls())
    cfg = compose(["model=tiny", f"explorer._target_=test_explorer_checks.{cls.__name__}"])
    with pytest.raises(ConfigError, match="^explorer: " + message):
        build_explorer(cfg.explorer)


def test_ngrpo_train_says_it_in_one_line_and_loads_nothing(capsys, monkeypatch):
    loads = []
    monkeypatch.setattr("ngrpo_lightning.build.components.load_policy", lambda *a, **k: loads.append(a))
    assert main(["train", "model=tiny", "explorer._target_=test_explorer_checks.ReturnsTokens"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ngrpo: error: explorer: ReturnsTokens.step returned a Tensor, not an ExplorerStep"], err
    assert not loads


@pytest.mark.parametrize("name", sorted(EXPLORERS))
def test_every_built_in_explorer_passes_its_trial_and_keeps_its_state(name):
    explorer = EXPLORERS[name]()
    before = repr(explorer)
    check_explorer(explorer)  # on a copy: the run's explorer is as it was built
    assert repr(explorer) == before and not hasattr(explorer, "embeddings")
