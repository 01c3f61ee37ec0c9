"""`ngrpo eval`: outputs (table, JSON, plot, MLflow run), checkpoints, and bad input."""

import json

import pytest
import torch
from conftest import fresh_store

from ngrpo_lightning.commands.cli import main


def run_error(capsys, *args):
    assert main(list(args)) == 2
    return capsys.readouterr().err


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_eval_on_a_benchmark_file_writes_table_json_and_plot(tmp_path, capsys):
    data = write_jsonl(
        tmp_path / "aime.jsonl", [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(3)]
    )
    out = tmp_path / "out"
    assert (
        main(
            [
                "eval",
                "model=tiny",
                "data=aime24",
                f"data.path={data}",
                "n=4",
                "max_new_tokens=4",
                "logger=none",
                f"output_dir={out}",
                "reward.num_workers=1",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "| Dataset | Mean@4 | Pass@1 | Pass@2 | Pass@4 |" in text and "| aime24 |" in text
    results = json.loads((out / "results.json").read_text())
    problems = results["sets"]["aime24"]["problems"]
    assert [p["answer"] for p in problems] == ["0", "2", "4"]
    assert all(p["n"] == 4 and 0 <= p["c"] <= 4 and len(p["answers"]) == 4 for p in problems)
    assert set(results["metrics"]) >= {
        "eval/aime24/pass@1",
        "eval/aime24/pass@4",
        "eval/aime24/mean@4",
        "eval/avg/pass@2",
    }
    assert results["ks"] == [1, 2, 4] and results["config"]["n"] == 4
    assert (out / "pass_at_k.md").read_text().startswith("| Dataset | Mean@4 |")
    assert (out / "pass_at_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpqa_file_becomes_multiple_choice_problems(tmp_path):
    from ngrpo_lightning.commands.eval import build_eval_sets, compose_eval

    data = write_jsonl(
        tmp_path / "gpqa.jsonl",
        [
            {
                "Question": "Q?",
                "Correct Answer": "yes",
                "Incorrect Answer 1": "a",
                "Incorrect Answer 2": "b",
                "Incorrect Answer 3": "c",
            }
        ],
    )
    cfg = compose_eval(["model=tiny", "data=gpqa_diamond", f"data.path={data}"])
    (ev,) = build_eval_sets(cfg)
    (p,) = ev.problems
    assert ev.name == "gpqa_diamond" and p.answer in "ABCD" and f"({p.answer}) yes" in p.question
    assert "letter" in ev.instruction


def test_k_larger_than_n_is_refused(capsys):
    err = run_error(capsys, "eval", "model=tiny", "n=4", "ks=[1,8]", "logger=none")
    assert "k=8" in err and "n=4" in err


@pytest.mark.parametrize(
    "override, message",
    [
        ("device=gpu", "device='gpu' is unknown: allowed ['auto', 'cpu', 'cuda']"),
        ("temperature=-1", "ngrpo: error: temperature=-1 is out of range"),  # eval's key, not an explorer's
        pytest.param(
            "device=cuda",
            "device=cuda but this machine has no CUDA GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without GPUs"),
        ),
    ],
)
def test_bad_sampling_and_device_settings_are_named(capsys, override, message):
    assert message in run_error(capsys, "eval", "model=tiny", override, "logger=none")


def test_missing_answer_field_names_field_and_file(capsys, tmp_path):
    bad = write_jsonl(tmp_path / "amc.jsonl", [{"question": "1+1?", "solution": "2"}])
    err = run_error(capsys, "eval", "model=tiny", "data=amc23", f"data.path={bad}", "logger=none")
    assert "'answer'" in err and str(bad) in err and "solution" in err


def test_unknown_key_lists_valid_keys(capsys):
    err = run_error(capsys, "eval", "model=tiny", "samples=8")
    assert "samples" in err and "'n'" in err and "'temperature'" in err


def test_checkpoint_policy_weights_are_loaded(tmp_path, tiny):
    from ngrpo_lightning.commands.eval import compose_eval, load_eval_policy

    policy = tiny[0]
    weights = {f"policy.{k}": v + 1.0 for k, v in policy.state_dict().items()}
    ckpt = tmp_path / "step.ckpt"
    torch.save({"state_dict": weights, "hyper_parameters": {"cfg": {"model": {"name_or_path": "tiny"}}}}, ckpt)
    for overrides in ([f"model={ckpt}"], ["model=tiny", f"checkpoint={ckpt}"]):
        loaded, _ = load_eval_policy(compose_eval(overrides))
        name, value = next(iter(loaded.state_dict().items()))
        assert torch.equal(value, weights[f"policy.{name}"]), overrides
    torch.save({"state_dict": weights}, ckpt)  # no base model named: must be given
    with pytest.raises(ValueError, match="does not name its base model"):
        load_eval_policy(compose_eval([f"model={ckpt}"]))


@pytest.mark.slow
def test_packaged_model_eval_logs_to_mlflow(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    uri, out = fresh_store(tmp_path / "mlflow.db"), tmp_path / "out"
    assert (
        main(
            [
                "eval",
                "data=reasoning_gym",
                "data.val_size=3",
                "n=8",
                "max_new_tokens=16",
                "temperature=0.7",
                "reward.num_workers=1",
                f"logger.tracking_uri={uri}",
                f"output_dir={out}",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    print(text)
    results = json.loads((out / "results.json").read_text())
    assert [p["n"] for p in results["sets"]["reasoning_gym"]["problems"]] == [8] * 3
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("eval").experiment_id])
    assert run.data.metrics["eval/reasoning_gym/pass_at_8"] == pytest.approx(
        results["metrics"]["eval/reasoning_gym/pass@8"]
    )
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"results.json", "pass_at_k.md", "pass_at_k.png"}
    assert run.data.params["model.name_or_path"] == "smollm2-135m-instruct" and run.data.params["n"] == "8"
