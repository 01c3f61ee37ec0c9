"""TemperatureExplorer and the sampling filters."""

import pytest
import torch
from omegaconf import OmegaConf

from ngrpo_lightning.build.components import build_explorer
from ngrpo_lightning.config import ConfigError
from ngrpo_lightning.explorers import TemperatureExplorer, filter_logits
from ngrpo_lightning.explorers.sampling import blockwise_cumsum, cumulative


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


@pytest.mark.parametrize("width, block", [(49152, 1024), (151936, 128), (4096, 64)])
def test_a_blockwise_scan_gives_the_cumulative_sums(width, block):
    """The GPU's scan of a vocabulary's probabilities (sums within blocks, plus the blocks before)
    gives ``cumsum``'s values up to float rounding, zero-probability entries included; the CPU
    keeps ``cumsum`` itself."""
    g = torch.Generator().manual_seed(0)
    probs = (3 * torch.randn(4, width, generator=g)).softmax(-1)
    probs[:, ::block] = 0.0  # each block starts with a token that must never be drawn
    probs /= probs.sum(-1, keepdim=True)
    flat, blocks = probs.cumsum(-1), blockwise_cumsum(probs, block)
    torch.testing.assert_close(blocks, flat, rtol=0, atol=2e-6)
    assert torch.equal(cumulative(probs), flat)  # on the CPU: cumsum
    u = (1.0 - torch.rand(4, 2000, generator=g)) * blocks[:, -1:]  # in (0, total], as the sampler draws
    drawn = torch.searchsorted(blocks, u).clamp(max=width - 1)
    assert (probs.gather(-1, drawn) > 0).all()  # never a zero-probability token


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: its scans are blockwise")
def test_sampling_on_a_gpu_draws_the_right_frequencies_and_never_a_zero_probability_token():
    """On a GPU the sampler scans a vocabulary's width in blocks (``cumulative``): the frequencies
    are still the probabilities, and tokens of probability zero (here at blocks' starts) are never drawn."""
    width = 4096
    probs = torch.zeros(width)
    probs[[1, 1024, 1025, 4095]] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().repeat(50000, 1).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = TemperatureExplorer(temperature=1.0).step(logits, gen).tokens.cpu()
    freq = torch.bincount(tokens, minlength=width).float() / len(tokens)
    assert freq[[1, 1024, 1025, 4095]].sum() == 1.0
    assert torch.allclose(freq[[1, 1024, 1025, 4095]], torch.tensor([0.4, 0.3, 0.2, 0.1]), atol=0.01)


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
