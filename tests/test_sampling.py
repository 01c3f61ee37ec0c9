"""TemperatureExplorer and the sampling filters."""

import pytest
import torch
from omegaconf import OmegaConf

from ngrpo_lightning.build.components import build_explorer
from ngrpo_lightning.config import ConfigError
from ngrpo_lightning.explorers import TemperatureExplorer, filter_logits


def test_filters_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda out: torch.isfinite(out)[0].tolist()  # noqa: E731
    assert keep(filter_logits(logits, top_k=2)) == [True, True, False, False]
    assert keep(filter_logits(logits, top_p=0.7)) == [True, True, False, False]  # 0.5 < 0.7 <= 0.8
    assert keep(filter_logits(logits, top_p=0.5)) == [True, False, False, False]
    assert keep(filter_logits(logits, min_p=0.25)) == [True, True, True, False]  # 0.15 >= 0.125


def test_greedy_and_sampling_frequencies():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(20000, 1)
    assert (TemperatureExplorer(temperature=0.0).step(logits).tokens == 0).all()
    gen = torch.Generator().manual_seed(0)
    tokens = TemperatureExplorer(temperature=1.0).step(logits, gen).tokens
    freq = torch.bincount(tokens, minlength=3).float() / len(tokens)
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.015)
    # T = 0.5 sharpens: p ~ p^2 renormalized
    tokens = TemperatureExplorer(temperature=0.5).step(logits, gen).tokens
    sharp = torch.tensor([0.49, 0.04, 0.01]) / 0.54
    assert torch.allclose(torch.bincount(tokens, minlength=3).float() / len(tokens), sharp, atol=0.015)


def test_filtered_and_zero_probability_tokens_are_never_sampled():
    logits = torch.log(torch.tensor([[0.0, 0.45, 0.0, 0.35, 0.2, 0.0]])).repeat(50000, 1)  # zeros first and last
    gen = torch.Generator().manual_seed(1)
    tokens = TemperatureExplorer(temperature=1.0).step(logits, gen).tokens
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    assert freq[[0, 2, 5]].sum() == 0
    assert torch.allclose(freq[[1, 3, 4]], torch.tensor([0.45, 0.35, 0.2]), atol=0.01)
    top2 = TemperatureExplorer(temperature=1.0, top_k=2).step(logits, gen).tokens
    assert set(top2.tolist()) == {1, 3}


def test_explorer_step_is_discrete():
    step = TemperatureExplorer().step(torch.randn(4, 10))
    assert step.mixed is None and step.tokens.shape == (4,)


@pytest.mark.parametrize("key, value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -3), ("min_p", 1.5)])
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"explorer.{key}"):
        build_explorer(OmegaConf.create({"name": "temperature", key: value}))


def test_unknown_explorer_and_parameter_are_named():
    with pytest.raises(ConfigError, match=r"explorer.name='nope' is unknown: allowed \[.*'temperature'"):
        build_explorer(OmegaConf.create({"name": "nope"}))
    with pytest.raises(ConfigError, match="explorer.rho is not a parameter of TemperatureExplorer"):
        build_explorer(OmegaConf.create({"name": "temperature", "rho": 0.1}))
    with pytest.raises(ConfigError, match="explorer._target_='no.such.Class' cannot be imported"):
        build_explorer(OmegaConf.create({"_target_": "no.such.Class"}))
