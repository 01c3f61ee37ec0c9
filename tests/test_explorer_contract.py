"""What is checked of a user-written explorer, where the framework takes its work: the fields of
each step it returns, and the temperature its log-probs are recorded at."""

import pytest
import torch

from ngrpo_lightning.build.components import check_temperature
from ngrpo_lightning.config import ConfigError
from ngrpo_lightning.explorers import Explorer, ExplorerStep, TemperatureExplorer, explorer_step


def test_a_step_that_is_not_what_the_engines_read_is_named_by_field_and_explorer():
    """A user's explorer's mistakes, caught where the step is made (shapes and dtypes only, no
    wait for the device): before, each failed deep in the engine's bookkeeping."""
    B, tokens = 3, torch.tensor([1, 2, 3])
    cases = [
        (
            {"tokens": tokens[:, None]},
            r"`tokens` must be a \[B\] tensor \(integer token ids\).*got torch.int64 \[3, 1\]",
        ),
        ({"tokens": tokens.float()}, r"`tokens` must be a \[B\] tensor \(integer token ids\)"),
        (
            {"tokens": tokens, "mixed": torch.ones(B), "ids": tokens[:, None], "weights": torch.ones(B, 1)},
            r"`mixed`.*bool",
        ),
        ({"tokens": tokens, "mixed": torch.ones(B, dtype=torch.bool)}, "needs `ids` and `weights`"),
        ({"tokens": tokens, "ids": tokens[:, None], "weights": torch.ones(B)}, r"`weights` must be a \[B, K\] tensor"),
        ({"tokens": tokens, "ids": tokens[:, None], "weights": torch.ones(B, 2)}, "must have the shape of `ids`"),
        ({"tokens": tokens, "noise_seed": 123, "noise_scale": 0.1}, r"`noise_seed` must be a \[B\] tensor.*got int"),
        ({"tokens": tokens, "noise_seed": tokens}, "come together"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            ExplorerStep(**fields)

    class ReturnsTokens(Explorer):
        def step(self, logits, generator=None):
            return logits.argmax(-1)

    class FlatWeights(Explorer):
        def step(self, logits, generator=None):
            ids = logits.argmax(-1)
            return ExplorerStep(ids, torch.ones(len(ids), dtype=torch.bool), ids[:, None], torch.ones(len(ids)))

    logits = torch.randn(B, 10)
    with pytest.raises(TypeError, match="ReturnsTokens.step returned a Tensor, not an ExplorerStep"):
        explorer_step(ReturnsTokens(), logits, None)
    with pytest.raises(ValueError, match=r"FlatWeights.step: ExplorerStep: `weights` must be a \[B, K\] tensor"):
        explorer_step(FlatWeights(), logits, None)
    assert explorer_step(TemperatureExplorer(1.0), logits, None).tokens.shape == (B,)


def test_an_explorer_that_samples_through_another_must_say_its_temperature():
    """Log-probs are recorded at the explorer's own temperature: one that samples at 0.7 through a
    TemperatureExplorer but leaves its own at the base class's 1.0 trained on the wrong log-probs."""

    class Forgot(Explorer):
        def __init__(self, t=0.7):
            self.sampler = TemperatureExplorer(t)

        def step(self, logits, generator=None):
            return self.sampler.step(logits, generator)

    class Said(Forgot):
        def __init__(self, t=0.7):
            super().__init__(t)
            self.temperature = t

    with pytest.raises(ConfigError, match="Forgot samples through self.sampler at temperature 0.7 but leaves"):
        check_temperature(Forgot())
    check_temperature(Said())
    check_temperature(Forgot(1.0))  # the same temperature: nothing to say
