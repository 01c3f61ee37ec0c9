"""`ngrpo diagnose`: drift metrics on constructed cases, bad input, and both commands end to end
on the tiny model."""

import json
import math

import pytest
import torch
from conftest import fresh_store

from ngrpo_lightning.commands.cli import main
from ngrpo_lightning.commands.diagnose.drift import (
    Decoder,
    drift_metrics,
    gaussian_perturb,
    mix,
    run_drift,
    select_tokens,
    token_id,
)
from ngrpo_lightning.commands.diagnose.rollouts import group_metrics
from ngrpo_lightning.metrics import edit_distance
from ngrpo_lightning.rollout.engine import special_token_ids

# Five unit vectors in the plane: 0 at 0 deg, 1 at 36.9, 2 at 53.1, 3 at 180, 4 at 270.
PLANE = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [-1.0, 0.0], [0.0, -1.0]])
UNIFORM = torch.full((1, 3), 1 / 3)


def run_error(capsys, *args):
    assert main(list(args)) == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_space(tiny):
    model, tokenizer = tiny
    E = model.get_input_embeddings().weight.detach()
    exclude = special_token_ids(tokenizer, E.shape[0])
    ids, labels = select_tokens(tokenizer, None, exclude)
    return E, exclude, ids, labels


# ------------------------------------------------------------ constructed cases
def test_zero_scale_perturbation_decodes_to_the_original(tiny_space):
    E, exclude, ids, _ = tiny_space
    result = run_drift(E, ids, UNIFORM, scales=[0.0, 0.1], n=2, k=3, exclude_ids=exclude)
    zero, small = result["rows"][0], result["rows"][1]
    assert (zero["method"], zero["scale"]) == ("gaussian", 0.0)
    assert zero["same_frac"] == 1.0 and zero["neighborhood_frac"] == 1.0 and zero["examples"] == []
    assert zero["rel_norm"] == pytest.approx(0.0, abs=1e-6) and zero["cosine"] == pytest.approx(1.0, abs=1e-5)
    assert small["rel_norm"] == pytest.approx(0.1, rel=1e-4)  # the noise norm is exactly scale * ||e||
    assert torch.equal(gaussian_perturb(E[ids], 0.0), E[ids])


def test_token_mixed_with_itself_decodes_to_itself(tiny_space):
    E, exclude, ids, _ = tiny_space
    anchors = torch.tensor(ids)
    weights = torch.rand(len(ids), 3, generator=torch.Generator().manual_seed(0)).softmax(-1)
    mixed = mix(E, anchors[:, None].repeat(1, 3), weights)
    assert torch.allclose(mixed, E[anchors], atol=1e-6)
    assert torch.equal(Decoder(E, exclude)(mixed), anchors)
    # the pilot with all the weight on the anchor: no displacement, every token decodes to itself
    result = run_drift(E, ids, torch.tensor([[1.0, 0.0, 0.0]]), scales=[], n=2, k=3, exclude_ids=exclude)
    (mixing,) = [r for r in result["rows"] if r["method"] == "mixing"]
    assert mixing["same_frac"] == 1.0 and mixing["rel_norm"] == pytest.approx(0.0, abs=1e-6)


def test_constructed_embedding_matrix_gives_the_known_answer():
    result = run_drift(PLANE, [0, 3], UNIFORM, scales=[0.0], n=1, k=3)
    assert result["neighborhoods"] == {0: [0, 1, 2], 3: [3, 4, 2]}  # cosine neighbors, nearest first
    (mixing,) = [r for r in result["rows"] if r["method"] == "mixing"]
    # token 0: (e0 + e1 + e2) / 3 = (0.8, 0.467) lies at 30.3 deg, nearest to e1 (36.9 deg): a neighbor.
    # token 3: (e3 + e4 + e2) / 3 = (-0.133, -0.067) lies at 206.6 deg, nearest to e3 itself.
    assert mixing["same_frac"] == 0.5 and mixing["neighborhood_frac"] == 1.0
    mix0 = torch.tensor([0.8, 1.4 / 3])
    mix3 = torch.tensor([-0.4 / 3, -0.2 / 3])
    assert mixing["cosine"] == pytest.approx(((mix0[0] / mix0.norm()) + (-mix3[0] / mix3.norm())).item() / 2, abs=1e-5)
    assert mixing["rel_norm"] == pytest.approx(
        ((mix0 - PLANE[0]).norm() + (mix3 - PLANE[3]).norm()).item() / 2, abs=1e-5
    )
    assert mixing["nearest_cosine"] == pytest.approx(
        (math.cos(math.radians(36.87 - 30.26)) + mix3[0].abs().item() / mix3.norm().item()) / 2, abs=1e-3
    )
    assert mixing["examples"] == ["'0' -> '1'"]
    # excluding token 1 (as special tokens are excluded): 0's neighborhood becomes [0, 2, 4] and the mixture
    # (1.6, -0.2) / 3 decodes to 0 itself
    result = run_drift(PLANE, [0], UNIFORM, scales=[], n=1, k=3, exclude_ids=[1])
    assert result["neighborhoods"] == {0: [0, 2, 4]} and result["rows"][0]["same_frac"] == 1.0


def test_decoder_ties_and_chunks():
    E = torch.cat([PLANE, PLANE[1:2]])  # row 5 duplicates row 1
    query = torch.tensor([[0.8, 0.6], [0.0, -3.0], [0.75, 0.65], [-1.0, 0.1]])
    for chunk in (2, 3, 100):  # chunk borders must not change the answer; ties go to the lowest id
        assert Decoder(E, chunk_size=chunk)(query).tolist() == [1, 4, 1, 3]
    assert Decoder(E, exclude_ids=[1])(query).tolist() == [5, 4, 5, 3]


def test_drift_metrics_neighborhood_fraction():
    anchors, hoods = torch.tensor([0, 0, 0, 0]), torch.tensor([[0, 1, 2]] * 4)
    originals = PLANE[anchors]
    m = drift_metrics(anchors, originals, originals, torch.tensor([0, 1, 2, 3]), hoods)
    assert m["same_frac"] == 0.25 and m["neighborhood_frac"] == 0.75 and m["rel_norm"] == 0.0


def test_token_selection(tiny):
    _, tokenizer = tiny
    exclude = special_token_ids(tokenizer, len(tokenizer))
    ids, labels = select_tokens(tokenizer, None, exclude)
    assert {"7", "+", "=", " the"} <= set(labels) and len(ids) == len(set(ids))
    assert all(tokenizer.decode([i]) == text for i, text in zip(ids, labels))  # "×" is the character, not byte 0xD7
    assert token_id(tokenizer, "Ġthe") == token_id(tokenizer, " the")
    with pytest.raises(ValueError, match="'qq zz'.*'also missing'"):
        select_tokens(tokenizer, ["7", "qq zz", "also missing"], exclude)


def test_edit_distance_and_group_metrics():
    assert edit_distance(list("kitten"), list("sitting")) == 3
    assert edit_distance([], [1, 2]) == 2 and edit_distance([1, 2, 3], [1, 2, 3]) == 0
    m = group_metrics([[1, 2, 3], [1, 2, 3], [4, 5]], [True, False, False], ["6", "6", None])
    assert m["mean@3"] == pytest.approx(1 / 3) and m["pass@3"] == 1.0 and m["distinct_answers"] == 1.0
    assert m["edit_distance"] == pytest.approx((0 + 3 + 3) / 3) and m["edit_distance_norm"] == pytest.approx(2 / 3)
    assert m["length"] == pytest.approx(8 / 3) and m["distinct_1gram"] == pytest.approx(5 / 8)


# ------------------------------------------------------------------- bad input
def test_tokens_missing_from_the_vocabulary_are_named(capsys):
    err = run_error(capsys, "diagnose", "drift", "model=tiny", "logger=none", "tokens=[7,'qq zz',+,xyzzyplugh]")
    assert "tokens: ['qq zz', 'xyzzyplugh'] not in the vocabulary" in err  # exactly the missing ones


def test_unknown_explorer_lists_the_valid_ones(capsys):
    err = run_error(capsys, "diagnose", "rollouts", "model=tiny", "logger=none", "explorers=[temperature,bogus]")
    assert "'bogus'" in err and all(f"'{n}'" in err for n in ("temperature", "ngrpo", "stht", "gumbel", "neighbor"))
    err = run_error(capsys, "diagnose", "rollouts", "model=tiny", "logger=none", "+explorer_args.ngrpo.rhoo=1")
    assert "ngrpo" in err and "rhoo" in err and "'rho'" in err  # names the explorer, the bad key and the valid ones
    err = run_error(
        capsys,
        "diagnose",
        "rollouts",
        "model=tiny",
        "logger=none",
        "explorers=[temperature]",
        "+explorer_args.stht.sigma=1",
    )
    assert "explorer_args.stht" in err and "temperature" in err


def test_unknown_mode_and_key_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["diagnose", "drfit", "model=tiny"])
    assert exc.value.code == 2 and "drift" in capsys.readouterr().err
    err = run_error(capsys, "diagnose", "drift", "model=tiny", "samples=3")
    assert "samples" in err and "'n'" in err and "'scales'" in err


# ------------------------------------------------------------------ end to end
def test_drift_command_writes_table_json_plot_and_mlflow_run(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    uri, out = fresh_store(tmp_path / "mlflow.db"), tmp_path / "out"
    assert (
        main(
            [
                "diagnose",
                "drift",
                "model=tiny",
                f"output_dir={out}",
                f"logger.tracking_uri={uri}",
                "n=2",
                "G=4",
                "max_new_tokens=12",
                "weight_prompts=2",
                "scales=[0.1,1.0,8.0]",
            ]
        )
        == 0
    )
    assert "| Gaussian σ=0.1 |" in capsys.readouterr().out
    data = json.loads((out / "drift.json").read_text())
    rows = {(r["method"], r["scale"]) if r["method"] == "gaussian" else r["method"]: r for r in data["rows"]}
    assert set(rows) == {("gaussian", 0.1), ("gaussian", 1.0), ("gaussian", 8.0), "mixing", "gaussian_matched"}
    assert all(0 <= r["same_frac"] <= r["neighborhood_frac"] <= 1 and -1 <= r["cosine"] <= 1 for r in data["rows"])
    assert rows[("gaussian", 0.1)]["same_frac"] == 1.0 and rows[("gaussian", 8.0)]["same_frac"] < 0.5
    assert rows["gaussian_matched"]["rel_norm"] == pytest.approx(rows["mixing"]["rel_norm"], rel=1e-4)
    assert data["weight_pool"]["size"] > 0 and sum(data["weight_pool"]["mean"]) == pytest.approx(1.0, abs=1e-4)
    assert len(data["tokens"]) == len(data["neighborhoods"]) > 20
    assert (out / "drift.md").read_text().startswith("| method |")
    assert (out / "drift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("diagnose").experiment_id])
    assert run.info.run_name == "drift" and run.data.params["k"] == "3"
    assert run.data.metrics["drift/mixing/same_frac"] == pytest.approx(rows["mixing"]["same_frac"])
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"drift.md", "drift.json", "drift.png"}


def test_rollouts_command_compares_explorers_on_the_same_prompts(tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        main(
            [
                "diagnose",
                "rollouts",
                "model=tiny",
                "logger=none",
                f"output_dir={out}",
                "limit=2",
                "G=3",
                "max_new_tokens=6",
                "explorers=[temperature,ngrpo,stht,gumbel,grpo,n-gspo]",
                "+explorer_args.n-gspo.rho=1.0",
            ]
        )
        == 0
    )
    assert "| explorer | Mean@3 | Pass@3 |" in capsys.readouterr().out
    data = json.loads((out / "rollouts.json").read_text())
    results = data["results"]
    assert list(results) == ["temperature", "ngrpo", "stht", "gumbel", "grpo", "n-gspo"]
    for name, res in results.items():
        m = res["metrics"]
        assert len(res["groups"]) == 2 and all(len(g["responses"]) == 3 for g in res["groups"]), name
        assert 0 <= m["mean@3"] <= m["pass@3"] <= 1 and 0 < m["distinct_1gram"] <= 1 and 0 < m["length"] <= 6, name
        assert 0 <= m["edit_distance_norm"] <= 1 and m["distinct_answers"] <= 3, name
    assert results["temperature"]["metrics"]["mixed_frac"] == 0 and results["stht"]["metrics"]["mixed_frac"] == 1.0
    assert results["n-gspo"]["metrics"]["mixed_frac"] == 1.0  # explorer_args: neighbor mixing at every step
    # `grpo` is plain sampling too: same prompts, same seed, so the very same responses
    assert results["grpo"]["groups"] == results["temperature"]["groups"]
    assert (
        "NeighborMixingExplorer" in data["explorers"]["ngrpo"] and "GaussianNoiseExplorer" in data["explorers"]["stht"]
    )
    assert (out / "rollouts.md").read_text().count("\n") == 2 + 6
    assert (out / "rollouts.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
