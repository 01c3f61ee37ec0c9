"""`ngrpo compare`: the bootstrap and the paired comparison on known data, then a real sweep of
the tiny model compared from its MLflow store, and the refusals."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_JOB
from mlflow import MlflowClient

from ngrpo_lightning.commands.cli import main
from ngrpo_lightning.commands.compare import paired_differences, per_problem_scores, two_level_bootstrap


def test_two_level_bootstrap_on_known_data():
    assert two_level_bootstrap([[0.5] * 10, [0.5] * 4]) == (0.5, 0.5, 0.5)  # no spread, no width
    rng = np.random.default_rng(0)
    values = rng.random(400)
    mean, low, high = two_level_bootstrap([values], n_boot=4000)
    se = values.std() / math.sqrt(len(values))  # one seed: the ordinary bootstrap of a mean
    assert mean == pytest.approx(values.mean()) and low < mean < high
    assert (high - low) == pytest.approx(2 * 1.96 * se, rel=0.15)
    # seeds that disagree widen the interval beyond what their problems alone give
    spread = two_level_bootstrap([values[:200] * 0.2, values[200:] * 0.2 + 0.8], n_boot=2000)
    pooled = two_level_bootstrap([np.concatenate([values[:200] * 0.2, values[200:] * 0.2 + 0.8])], n_boot=2000)
    assert spread[2] - spread[1] > 3 * (pooled[2] - pooled[1])
    assert all(math.isnan(v) for v in two_level_bootstrap([]))


def test_per_problem_scores_and_paired_differences():
    results = {
        "sets": {
            "s": {
                "problems": [
                    {
                        "id": "a",
                        "n": 4,
                        "c": 1,
                        "answers": ["1", "2", "2", None],
                        "status": ["correct", *["wrong"] * 3],
                    },
                    {"id": "b", "n": 4, "c": 4, "answers": ["5"] * 4, "status": ["correct"] * 4},
                ]
            }
        }
    }
    scores = per_problem_scores(results, k=2)
    assert scores["s/a"] == {"pass@2": 0.5, "mean@4": 0.25, "maj@4": 0.0}  # 1 - C(3,2)/C(4,2); "2" wins the vote
    assert scores["s/b"] == {"pass@2": 1.0, "mean@4": 1.0, "maj@4": 1.0}
    other = {"s/a": {"pass@2": 1.0}, "s/c": {"pass@2": 0.0}}
    diffs = paired_differences({"0": scores, "1": scores}, {"0": other}, "pass@2")
    assert diffs == [[-0.5]]  # only seed 0 and problem a are in both


TINY = [*TINY_JOB, "data.val_size=3", "pass_at_k.n=4", "pass_at_k.max_new_tokens=4"]


def test_a_sweep_compared_from_its_store(store, tmp_path, capsys):
    sweep = ["train", "-m", *TINY, f"logger.tracking_uri={store}", "sweep=cmp"]
    assert main([*sweep, "seed=0,1", "experiment=grpo,stht", "trainer.max_steps=2"]) == 0
    capsys.readouterr()
    out = tmp_path / "report"
    assert main(["compare", "sweep=cmp", f"logger.tracking_uri={store}", "n_boot=200", f"output_dir={out}"]) == 0
    text = capsys.readouterr().out
    assert "# Comparison: sweep cmp (4 runs, 2 arms)" in text
    assert "| experiment=grpo | 0, 1 | 2 | 6 |" in text and "| experiment=stht | 0, 1 | 2 | 6 |" in text
    assert "| arm | Pass@1 | Pass@2 | Pass@4 | Mean@4 | Maj@4 |" in text
    assert "| experiment=grpo | experiment=stht | pass@1 | 6 |" in text
    assert "Not comparable" not in text
    best = [line for line in text.splitlines() if line.startswith("| experiment=") and line.endswith(".ckpt` |")]
    assert len(best) == 2 and all(Path(line.rsplit("`", 2)[1]).exists() for line in best)  # each arm's checkpoint
    data = json.loads((out / "compare.json").read_text())
    for info in data["tables"]["arms"].values():
        mean, low, high = info["final"]["pass@1"]
        assert 0 <= low <= mean <= high <= 1
        assert info["means"]["time/step_s"][0] > 0 and 0 <= info["means"]["explore/edit_distance_norm"][0] <= 1
    for name in ("curves_step.png", "curves_time.png", "pass_at_k.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("compare").experiment_id])
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"compare.md", "compare.json", "pass_at_k.png"}

    # a third arm with another budget is flagged, not averaged in silently
    assert main([*sweep, "seed=0", "experiment=gumbel", "trainer.max_steps=1"]) == 0
    capsys.readouterr()
    assert main(["compare", "sweep=cmp", f"logger.tracking_uri={store}", "n_boot=50", f"output_dir={out}"]) == 0
    text = capsys.readouterr().out
    assert "**Not comparable" in text and "`trainer.max_steps` differs: experiment=grpo: 2" in text

    # refusals
    base = ["compare", f"store={store}", "logger=none"]
    assert main([*base, "sweep=nope"]) == 2
    assert "sweep='nope' has no runs in this store; sweeps here: ['cmp']" in capsys.readouterr().err
    assert main([*base, "experiments=[grpo,nope]"]) == 2
    assert "experiment 'nope' is not in this store; experiments here: [" in capsys.readouterr().err
    assert main([*base, "experiments=[grpo]"]) == 2
    assert "a comparison needs two arms" in capsys.readouterr().err
    assert main([*base, "runs=[0123456789abcdef]"]) == 2
    assert "run '0123456789abcdef' is not in this store" in capsys.readouterr().err
