"""`ngrpo compare`: the paired comparison on known data, then a real sweep of the tiny model
compared from its MLflow store, and the refusals (the statistics themselves: test_compare_power.py)."""

import json
from pathlib import Path

from conftest import TINY_JOB
from mlflow import MlflowClient

from ngrpo_lightning.commands.cli import main
from ngrpo_lightning.commands.compare import paired_differences, per_problem_scores
from ngrpo_lightning.commands.compare.runs import RunData, code_of, code_versions
from ngrpo_lightning.tracking.code_version import PACKAGE, code_tags


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


TINY = [*TINY_JOB, "data.val_size=3", "pass_at_k.n=4", "pass_at_k.max_new_tokens=4", "pass_at_k.every_n_steps=1"]


def test_a_sweep_compared_from_its_store(store, tmp_path, capsys):
    sweep = ["train", "-m", *TINY, f"logger.tracking_uri={store}", "sweep=cmp"]
    assert main([*sweep, "seed=0,1", "experiment=grpo,stht", "trainer.max_steps=2"]) == 0
    assert f"compare the arms: ngrpo compare sweep=cmp store={store}" in capsys.readouterr().out
    out = tmp_path / "report"
    assert main(["compare", "sweep=cmp", f"store={store}", f"output_dir={out}"]) == 0  # its own run logged there too
    text = capsys.readouterr().out
    assert "replaced:" not in text  # a new folder
    assert "# Comparison: sweep cmp (4 runs, 2 arms)" in text
    assert "| experiment=grpo | 0, 1 | 2 | 6 |" in text and "| experiment=stht | 0, 1 | 2 | 6 |" in text
    assert "| arm | Pass@1 | Pass@2 | Pass@4 | Mean@4 | Maj@4 |" in text
    assert "| seed | experiment=grpo | experiment=stht |" in text  # per seed: a row each
    tags = code_tags()
    if "mlflow.source.git.commit" in tags:  # the runs name the code they ran (from a git checkout)
        assert f"Code: {code_of(tags)} for all 4 runs." in text
    else:
        assert "Code: not recorded." in text
    assert sum(line.startswith(("| 0 | ", "| 1 | ")) and line.count(" / ") == 2 for line in text.splitlines()) == 2
    assert text.index("## Verdicts") < text.index("## What this sweep can detect") < text.index("## Arms")
    assert text.index("## What this sweep can detect") < text.index("## How the verdicts moved with the seeds")
    assert "| experiment=grpo | experiment=stht | pass@1 | " in text.split("## How the verdicts moved")[1]
    assert "- **Pass@1**, experiment=grpo vs experiment=stht: " in text
    assert "| experiment=grpo | experiment=stht | pass@1 | 2 | 3 |" in text  # seeds, problems per seed
    assert "| at the estimate, seeds to bound within 5.0 / to show it |" in text
    # a joint statement only where the verdicts it joins each bound a difference (an inconclusive one bounds nothing)
    bounded = [line for line in text.splitlines() if line.startswith("- **") and ": no difference larger than" in line]
    assert ("Read together (" in text) == (len(bounded) > 1)
    verdicts = [line for line in text.splitlines() if line.startswith("- **Pass@")]
    assert verdicts and all(line.rstrip().endswith((".", ")", "]")) for line in verdicts), verdicts  # whole sentences
    assert "## Curves against compute" in text and "Posterior Pass@k" in text
    from ngrpo_lightning.commands.compare.curves import along_run_keys, compute_points
    from ngrpo_lightning.commands.compare.runs import load_run

    client = MlflowClient(store)
    run = load_run(client, client.get_run(json.loads((out / "compare.json").read_text())["runs"][0]["run_id"]))
    assert along_run_keys([run]) == ["val/reasoning_gym/pass_at_1", "val/reasoning_gym/pass_at_4"]
    steps = [c["step"] for c, _ in compute_points(run, "val/reasoning_gym/pass_at_1")]
    assert steps == [1.0, 2.0]  # evaluated after each of the 2 optimizer steps
    assert [c["step"] for c, _ in compute_points(run, "val/accuracy")] == [0.0, 2.0]  # before training and at the end
    assert "Not comparable" not in text
    best = [line for line in text.splitlines() if line.startswith("| experiment=") and line.endswith(".ckpt` |")]
    assert len(best) == 2 and all(Path(line.rsplit("`", 2)[1]).exists() for line in best)  # each arm's checkpoint
    data = json.loads((out / "compare.json").read_text())
    assert all([h["seeds"] for h in p["history"]] == [2] for p in data["tables"]["paired"])
    for info in data["tables"]["arms"].values():
        mean, low, high = info["final"]["pass@1"]
        assert 0 <= low <= mean <= high <= 1
        assert info["means"]["time/step_s"][0] > 0 and 0 <= info["means"]["explore/edit_distance_norm"][0] <= 1
    for name in ("curves_step.png", "curves_time.png", "compute.png", "pass_at_k.png", "seeds.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("compare").experiment_id])
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"compare.md", "compare.json", "pass_at_k.png"}

    assert main(["compare", "sweep=cmp", "logger=none", f"store={store}", "detect=0.03", f"output_dir={out}"]) == 0
    again = capsys.readouterr().out  # into the same folder: the report says which one it replaced
    assert "## What this sweep can detect, and what 3.0 points would take" in again
    assert "  replaced:   the report written there at " in again and "(Comparison: sweep cmp (4 runs, 2 arms))" in again

    # a third arm with another budget is flagged, not averaged in silently
    assert main([*sweep, "seed=0", "experiment=gumbel", "trainer.max_steps=1"]) == 0
    capsys.readouterr()
    assert main(["compare", "sweep=cmp", f"logger.tracking_uri={store}", f"output_dir={out}"]) == 0
    text = capsys.readouterr().out
    assert "**Not comparable" in text and "`trainer.max_steps` differs: experiment=grpo: 2" in text
    # its Pass@k is of step 1, theirs of step 2
    steps = "the last Pass@k evaluation is of different steps: experiment=grpo: 2; experiment=stht: 2; "
    assert steps + "gumbel x grpo: 1" in text

    # refusals
    base = ["compare", f"store={store}", "logger=none"]
    assert main([*base, "sweep=nope"]) == 2
    assert "sweep='nope' has no runs in " + store + "; sweeps there: ['cmp']" in capsys.readouterr().err
    assert main([*base, "experiments=[grpo,nope]"]) == 2
    assert "experiment 'nope' is not in " + store + "; experiments there: [" in capsys.readouterr().err
    assert main([*base, "experiments=[grpo]"]) == 2
    assert "a comparison needs two arms" in capsys.readouterr().err
    assert main([*base, "sweep=cmp", "detect=5"]) == 2
    assert "detect=5 must be a number in (0, 1] (a fraction, 0.05 = 5 points)" in capsys.readouterr().err
    assert main([*base, "runs=[0123456789abcdef]"]) == 2
    assert "run '0123456789abcdef' is not in " + store in capsys.readouterr().err
    nowhere = f"sqlite:///{tmp_path}/nowhere/mlflow.db"
    assert main(["compare", f"store={nowhere}", "logger=none", "sweep=cmp"]) == 2
    assert f"store={nowhere}: no MLflow store there" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()  # read, never created
    # a path: the SQLite file or the folder holding mlflow.db (./mlruns); MLflow would take it as a file store
    assert main(["compare", f"store={tmp_path}/mlruns", "logger=none", "sweep=nope"]) == 2
    assert "sweeps there: ['cmp']" in capsys.readouterr().err
    assert main(["compare", f"store={tmp_path}/nowhere", "logger=none", "sweep=cmp"]) == 2
    assert f"store={tmp_path}/nowhere: no MLflow store there" in capsys.readouterr().err


def test_runs_are_tagged_with_the_code_they_ran_and_a_report_says_when_it_differs(tmp_path, monkeypatch):
    import subprocess

    tags = code_tags()
    assert tags["ngrpo.version"]
    head = subprocess.run(["git", "-C", str(PACKAGE), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # imported from a git checkout (CI's clone): the commit is known
        assert tags["mlflow.source.git.commit"] == head.stdout.strip()
        assert tags["ngrpo.git_dirty"] in ("true", "false")
    assert code_of({"mlflow.source.git.commit": "0123456789abcdef", "ngrpo.git_dirty": "true"}) == "0123456789+changes"
    assert code_of({}) == ""
    # installed (untracked) inside some other repository: that repository's commit is not the code's
    from ngrpo_lightning.tracking import code_version

    installed = tmp_path / "venv" / "ngrpo_lightning"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.setattr(code_version, "PACKAGE", installed)
    assert code_version.code_tags.__wrapped__() == {"ngrpo.version": tags["ngrpo.version"]}

    def run(code):
        return RunData("id", "arm", "0", "exp", "FINISHED", {}, 0, code=code)

    assert code_versions([run("aaa"), run("aaa")]) == "Code: aaa for all 2 runs."
    assert code_versions([run(""), run("")]) == "Code: not recorded."
    mixed = code_versions([run("aaa"), run("aaa"), run("bbb+changes")])
    assert mixed.startswith("Code: 2 versions (aaa (2 runs), bbb+changes (1 run))")
