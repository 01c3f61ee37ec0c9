"""Every explorer in HFEngine and in training: the training forward rebuilds exactly the
inputs the rollout saw; exploration metrics; experiment configs; a user explorer from the
docs run from the command line."""

import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import ONE_TINY_STEP, chat_prompt_ids

from ngrpo_lightning.explorers import (
    GaussianEmbedNoiseExplorer,
    GaussianNoiseExplorer,
    GumbelSoftExplorer,
    NeighborMixingExplorer,
    OrthogonalNoiseExplorer,
    TopKGumbelMixExplorer,
    TopKMixExplorer,
)
from ngrpo_lightning.metrics.exploration import exploration_metrics
from ngrpo_lightning.rollout import HFEngine
from ngrpo_lightning.training.forward import response_logprobs

QUESTIONS = ["What is 7 + 5?", "What is 3 * 4?"]
ROOT = Path(__file__).resolve().parent.parent

EXPLORERS = {  # mixing often, so that many steps are non-discrete
    "neighbor": lambda: NeighborMixingExplorer(k=3, rho=0.5),
    "neighbor-l1-every-step": lambda: NeighborMixingExplorer(k=4, rho=1.0, metric="l1", temperature=0.8),
    "neighbor-release": lambda: NeighborMixingExplorer(k=2, rho=0.5, metric="dot", emit="sampled", top_p=0.9),
    "neighbor-entropy-gate": lambda: NeighborMixingExplorer(k=3, gate="entropy", entropy_threshold=0.5, top_k=50),
    "gaussian": lambda: GaussianNoiseExplorer(sigma=0.5, rho=0.5),
    "gumbel": lambda: GumbelSoftExplorer(top_k=5, tau=1.0),
    "topk": lambda: TopKMixExplorer(k=3, rho=0.5, top_p=0.9),
    "topk_gumbel": lambda: TopKGumbelMixExplorer(k=3, rho=0.5, mix_temperature=0.7),
    "gaussian_embed_noise": lambda: GaussianEmbedNoiseExplorer(k=2, rho=0.5),
    "orthogonal_noise": lambda: OrthogonalNoiseExplorer(k=3, rho=0.5, mix_temperature=0.7),
}


def check_round_trip(model, tok, explorer, max_new_tokens, min_records):
    """Roll out, then recompute log-probs from the reconstructed inputs (and without them)."""
    batch = HFEngine(model, tok, max_new_tokens=max_new_tokens, seed=1).generate(
        chat_prompt_ids(tok, QUESTIONS), explorer, n=2
    )
    assert len(batch.records) >= min_records
    mask = batch.response_mask.bool()
    with torch.no_grad():
        logp, _ = response_logprobs(model, batch, explorer.temperature)
        ignored, _ = response_logprobs(model, batch, explorer.temperature, use_records=False)
    assert (logp - batch.rollout_logprobs)[mask].abs().max() <= 1e-4  # mixed steps included
    assert (ignored - batch.rollout_logprobs)[mask].abs().max() > 1e-3  # negative control
    return batch


@pytest.mark.parametrize("name", list(EXPLORERS))
def test_round_trip_on_the_tiny_model(tiny, name):
    model, tok = tiny
    check_round_trip(model, tok, EXPLORERS[name](), max_new_tokens=12, min_records=4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["neighbor", "gaussian", "gumbel"])
def test_round_trip_on_the_packaged_model_fp32(smollm2, name):
    model, tok = smollm2
    assert model.dtype == torch.float32
    check_round_trip(model, tok, EXPLORERS[name](), max_new_tokens=24, min_records=8)


def test_engine_passes_special_ids_and_neighbors_avoid_them(tiny):
    model, tok = tiny
    explorer = NeighborMixingExplorer(k=3, rho=1.0)
    batch = HFEngine(model, tok, max_new_tokens=8, seed=0).generate(chat_prompt_ids(tok, QUESTIONS), explorer)
    special = set(tok.all_special_ids)
    assert special and set(explorer._index_key[0]) >= special
    assert not set(batch.records.ids[:, 1:].flatten().tolist()) & special


def test_exploration_metrics_of_a_neighbor_rollout(tiny):
    model, tok = tiny
    rho = 0.25
    batch = HFEngine(model, tok, max_new_tokens=40, seed=2).generate(
        chat_prompt_ids(tok, QUESTIONS), NeighborMixingExplorer(rho=rho), n=4
    )
    m = exploration_metrics(batch)
    n = int(batch.response_mask.sum())
    assert n > 200
    assert abs(m["explore/mixed_frac"] - rho) < 4.5 * math.sqrt(rho * (1 - rho) / n)  # binomial bound
    assert 0.0 < m["explore/mixture_entropy"] <= math.log(3) + 1e-6
    assert all(0.0 < m[f"explore/distinct_{k}gram"] <= 1.0 for k in range(1, 5))
    assert 0.0 < m["explore/distinct_answers_frac"] <= 1.0


def test_experiment_configs_select_the_explorers():
    from ngrpo_lightning.build.components import build_explorer
    from ngrpo_lightning.config import compose

    for experiment, cls in (
        ("ngrpo", NeighborMixingExplorer),
        ("stht", GaussianNoiseExplorer),
        ("gumbel", GumbelSoftExplorer),
    ):
        cfg = compose([f"experiment={experiment}"])
        assert cfg.experiment_name == experiment and type(build_explorer(cfg.explorer)) is cls
    ablation = build_explorer(compose(["experiment=ngrpo", "explorer.rho=1.0", "explorer.metric=l2"]).explorer)
    assert (ablation.k, ablation.rho, ablation.metric) == (3, 1.0, "l2")


def test_the_user_explorer_of_the_docs_trains_from_the_command_line(monkeypatch, tmp_path, capsys):
    """docs/explorers.md shows docs/examples/top_two_blend.py verbatim; run it by class path."""
    from ngrpo_lightning.commands.cli import main

    example = (ROOT / "docs" / "examples" / "top_two_blend.py").read_text()
    assert example.strip() in (ROOT / "docs" / "explorers.md").read_text()
    body = example.split("class TopTwoBlend", 1)[1].strip().splitlines()
    assert len(body) < 30
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples"))
    monkeypatch.chdir(tmp_path)
    argv = ["train", "explorer._target_=top_two_blend.TopTwoBlend", "explorer.rho=0.5", *ONE_TINY_STEP]
    assert main(argv) == 0
    assert "Trained 1 step " in capsys.readouterr().out
    assert main(argv[:2] + ["explorer.rho=2.0"] + argv[3:]) == 2  # the example's own check names the key
    assert "explorer.rho=2.0 is out of range" in capsys.readouterr().err
    sys.modules.pop("top_two_blend", None)


def test_distinct_answers_use_the_answers_the_reward_extracted():
    import torch

    from ngrpo_lightning.rollout import RolloutBatch

    ones = torch.ones(4, 2, dtype=torch.long)
    batch = RolloutBatch(
        prompt_ids=ones,
        prompt_mask=ones,
        response_ids=ones,
        response_mask=ones,
        rollout_logprobs=torch.zeros(4, 2),
        group_size=2,
        response_text=["a 1", "b 2", "c 3", "d 3"],
    )
    assert exploration_metrics(batch, ["1", "2", "3", "3"])["explore/distinct_answers_frac"] == 0.75  # (2/2 + 1/2) / 2
    assert exploration_metrics(batch)["explore/distinct_answers_frac"] == 0.5  # no boxes: one "None" answer per group


# --------------------------------------------------- no mixing after the answer marker
def first_completion(tokens: list[int], marker: list[int]) -> int | None:
    """Independent: the response position whose token completes ``marker`` first."""
    for end in range(len(marker) - 1, len(tokens)):
        if tokens[end - len(marker) + 1 : end + 1] == marker:
            return end
    return None


def two_token_marker(tok, batch, row=0):
    """A marker of two tokens that row ``row`` emitted (at positions >= 2), as text that encodes
    back to the same ids."""
    ids = batch.response_ids[row, : int(batch.response_lengths[row])].tolist()
    for start in range(2, len(ids) - 1):
        text = tok.decode(ids[start : start + 2])
        if tok(text, add_special_tokens=False)["input_ids"] == ids[start : start + 2]:
            return text, ids[start : start + 2]
    raise AssertionError("no two-token marker in the row")


def check_answer_marker(generate, tok, make_explorer, logprobs_of):
    """Roll out without a marker, take a two-token text row 0 emitted, roll out again with it as
    ``answer_start``: no record at or after each row's first completion, earlier steps as before,
    and the training forward still rebuilds the rollout's log-probs."""
    free = generate(make_explorer(None))
    text, marker = two_token_marker(tok, free)
    batch = generate(make_explorer(text))
    cut = first_completion(batch.response_ids[0].tolist(), marker)
    assert cut is not None and cut == first_completion(free.response_ids[0].tolist(), marker)
    assert bool((free.records.pos[free.records.row == 0] >= cut).any())  # without the marker, mixing went on
    for row in range(len(batch)):
        length = int(batch.response_lengths[row])
        end = first_completion(batch.response_ids[row, :length].tolist(), marker)
        positions = batch.records.pos[batch.records.row == row]
        if end is not None:
            assert bool((positions < end).all()), (row, end, positions.tolist())
    before = free.records.pos[free.records.row == 0]
    assert sorted(batch.records.pos[batch.records.row == 0].tolist()) == sorted(before[before < cut].tolist())
    mask = batch.response_mask.bool()
    assert (logprobs_of(batch) - batch.rollout_logprobs)[mask].abs().max() <= 1e-3


def test_no_mixing_after_the_answer_marker_in_hf_engine(tiny):
    model, tok = tiny

    def generate(explorer):
        return HFEngine(model, tok, max_new_tokens=16, seed=3).generate(chat_prompt_ids(tok, QUESTIONS), explorer, n=2)

    def logprobs_of(batch):
        with torch.no_grad():
            return response_logprobs(model, batch, 1.0)[0]

    check_answer_marker(
        generate, tok, lambda text: NeighborMixingExplorer(k=3, rho=0.6, emit="sampled", answer_start=text), logprobs_of
    )
