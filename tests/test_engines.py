"""Rollout engines as components: one registry rule for every kind, engines written outside the
package (the docs example), fixed-length rollouts, and what an engine shares with the others."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import ONE_TINY_STEP

from ngrpo_lightning.explorers import EXPLORERS, NeighborMixingExplorer, TemperatureExplorer
from ngrpo_lightning.objectives import ADVANTAGE_ESTIMATORS, OBJECTIVES, register_advantage
from ngrpo_lightning.rollout import ENGINES, HFEngine, RolloutEngine, check_engine

ROOT = Path(__file__).resolve().parents[1]


def test_every_registry_refuses_a_second_component_under_a_taken_name():
    for registry in (ENGINES, EXPLORERS, OBJECTIVES):
        name, taken = next(iter(registry.items()))
        with pytest.raises(ValueError, match=f"name {name!r} is already registered by"):
            registry.register(name)(type("Other", (taken,), {}))
        assert registry.register(name)(taken) is taken  # the same class again: a re-import, allowed
    with pytest.raises(ValueError, match="advantage estimator name 'grpo' is already registered"):
        register_advantage("grpo")(lambda r, eps: r)
    assert ADVANTAGE_ESTIMATORS["grpo"].__name__ == "grpo_advantage"


def test_an_engine_checks_its_settings_before_it_is_built():
    assert check_engine("hf", {"drop_min_frac": 0.5}) is HFEngine
    with pytest.raises(ValueError, match=r"rollout.hf.drop_min_frac=2 is out of range"):
        check_engine("hf", {"drop_min_frac": 2})
    with pytest.raises(ValueError, match=r"rollout.hf.beam is unknown: allowed \['drop_finished_rows'"):
        check_engine("hf", {"beam": 2})
    # how the products run is the backend's choice, and the backend is the run's, not a setting
    assert HFEngine.settings_names() == ["drop_finished_rows", "drop_min_frac"]
    for removed in ("packed_weights", "backend"):
        with pytest.raises(
            ValueError, match=rf"rollout.hf.{removed} is unknown: allowed \['drop_finished_rows', 'drop_min_frac'\]"
        ):
            check_engine("hf", {removed: True})
    with pytest.raises(ValueError, match=r"engine='nope' is unknown"):
        check_engine("nope", key="engine")


def test_an_explorer_count_given_a_fraction_is_refused_not_truncated():
    with pytest.raises(ValueError, match=r"explorer.k=2.5 must be an integer"):
        NeighborMixingExplorer(k=2.5)
    with pytest.raises(ValueError, match=r"explorer.top_k=1.5 must be an integer"):
        TemperatureExplorer(top_k=1.5)


def test_ignore_eos_decodes_every_row_to_the_limit(tiny):
    model, tok = tiny
    prompts = [tok("1 + 1 =")["input_ids"], tok("2 + 3 =")["input_ids"]]
    engine = HFEngine(model, tok, max_new_tokens=7, seed=0, ignore_eos=True)
    assert engine.eos_ids == [] and HFEngine(model, tok).eos_ids  # the model has EOS ids; ignored here
    batch = engine.generate(prompts, TemperatureExplorer(1.0), n=3)
    assert batch.response_mask.shape == (6, 7) and bool(batch.response_mask.all())
    assert batch.stats["rollout/tokens"] == 42 and bool(batch.truncated.all())


@pytest.fixture
def generate_engine(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples"))
    import generate_engine

    yield generate_engine.GenerateEngine
    sys.modules.pop("generate_engine", None)
    ENGINES.pop("hf_generate", None)


def test_the_docs_engine_is_shown_verbatim(generate_engine):
    example = (ROOT / "docs" / "examples" / "generate_engine.py").read_text()
    assert example.strip() in (ROOT / "docs" / "architecture.md").read_text()
    assert issubclass(generate_engine, RolloutEngine) and ENGINES["hf_generate"] is generate_engine
    assert check_engine("generate_engine.GenerateEngine") is generate_engine
    assert generate_engine.settings_names() == []


def test_the_docs_engine_decodes_what_hf_engine_decodes(generate_engine, tiny):
    model, tok = tiny
    prompts = [tok("1 + 1 =")["input_ids"], tok("12 + 30 =")["input_ids"]]
    greedy = TemperatureExplorer(temperature=0.0)
    ours = HFEngine(model, tok, max_new_tokens=6).generate(prompts, greedy, n=2)  # unprepared: plain products
    theirs = generate_engine.from_policy(model, tok, max_new_tokens=6, seed=0).generate(prompts, greedy, n=2)
    assert torch.equal(theirs.response_mask, ours.response_mask)
    assert torch.equal(theirs.response_ids, ours.response_ids)
    assert torch.allclose(theirs.rollout_logprobs, ours.rollout_logprobs, atol=1e-4)
    with pytest.raises(ValueError, match="GenerateEngine cannot run NeighborMixingExplorer: use hf"):
        generate_engine(model, tok).generate(prompts, NeighborMixingExplorer(k=2), n=1)


def test_the_docs_engine_trains_from_the_command_line(generate_engine, monkeypatch, tmp_path, capsys):
    from ngrpo_lightning.commands.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["train", "rollout.engine=generate_engine.GenerateEngine", *ONE_TINY_STEP]
    assert main(argv) == 0
    assert "Trained 1 step " in capsys.readouterr().out
    assert main([*argv, "explorer=neighbor"]) == 2  # refused before the model loads, naming the key
    assert "rollout.engine: GenerateEngine cannot run NeighborMixingExplorer: use hf" in capsys.readouterr().err
