"""Pass@k: the estimator against brute force, the torchmetrics metric (also reduced over 2
gloo processes), the GPQA formatter, and the PassAtK callback with ModelCheckpoint."""

import itertools
import json
import os
import socket
from fractions import Fraction
from math import comb

import pytest
import torch

from ngrpo_lightning.metrics import PassAtK, maj_at_k, mean_at_k, pass_at_k, powers_of_two


def brute_force(n, c, k):
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration_of_all_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 0, 8) == 0.0  # c = 0
    assert pass_at_k(8, 8, 1) == 1.0 and pass_at_k(8, 8, 8) == 1.0  # c = n
    assert pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 3, 8) == 1.0  # k = n: any correct sample counts
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # k = 1 is the accuracy
    with pytest.raises(ValueError, match=r"pass@9 needs at least k=9 samples per problem, got n=8"):
        pass_at_k(8, 2, 9)
    with pytest.raises(ValueError, match="more than n"):
        pass_at_k(4, 5, 1)
    for bad in ((0, 0, 1), (4, -1, 1), (4, 1, 0), (4, 1, 1.5)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_pass_at_k_is_exact_for_thousands_of_samples():
    for n, c, k in ((4096, 7, 1024), (5000, 1, 2500), (3000, 2990, 16), (2048, 100, 2048 - 100)):
        exact = 1 - Fraction(comb(n - c, k), comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9, abs=1e-12)


def test_powers_mean_and_majority():
    assert powers_of_two(8) == [1, 2, 4, 8] and powers_of_two(12) == [1, 2, 4, 8] and powers_of_two(1) == [1]
    assert mean_at_k([1, 0, 1, 1]) == 0.75 and mean_at_k([1, 0, 1, 1], k=2) == 0.5
    # "3" wins the vote (2 of 3 voters; None does not vote) and is correct
    assert maj_at_k(["3", None, "4", "3"], [1, 0, 0, 1]) == 1.0
    assert maj_at_k(["4", "4", "3", None], [0, 0, 1, 0]) == 0.0
    assert maj_at_k(["3", "4"], [1, 0]) == 1.0  # a tie goes to the answer seen first
    assert maj_at_k([None, None], [0, 0]) == 0.0
    with pytest.raises(ValueError):
        mean_at_k([1, 0], k=3)


def test_metric_averages_the_estimator_over_problems():
    correct = [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1]]
    answers = [["1", "2", "2", None], [None] * 4, ["5", "5", "6", "5"]]
    m = PassAtK()
    m.update(torch.tensor(correct[:2]), answers[:2])
    m.update(correct[2:], answers[2:])
    out = m.compute()
    assert sorted(out) == ["maj@4", "mean@4", "pass@1", "pass@2", "pass@4"]
    for k in (1, 2, 4):
        assert float(out[f"pass@{k}"]) == pytest.approx(sum(pass_at_k(4, sum(r), k) for r in correct) / 3)
    assert float(out["mean@4"]) == pytest.approx(4 / 12) and float(out["maj@4"]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="pass@8 needs at least 8 samples"):
        PassAtK(ks=[8]).update([[1, 0, 1, 0]])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROBLEMS = [[int(x) for x in f"{i * 37 % 256:08b}"] for i in range(7)]  # 7 problems x 8 samples
ANSWERS = [[str(b * (j % 3)) if j % 4 else None for j, b in enumerate(row)] for row in PROBLEMS]


def _rank_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        m = PassAtK()
        mine = list(range(rank, len(PROBLEMS), world))  # uneven shares: 4 and 3 problems
        m.update([PROBLEMS[i] for i in mine], [ANSWERS[i] for i in mine])
        out = {k: float(v) for k, v in m.compute().items()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def test_metric_reduced_over_two_gloo_processes_equals_single_process(tmp_path):
    single = PassAtK()
    single.update(PROBLEMS, ANSWERS)
    expected = {k: float(v) for k, v in single.compute().items()}
    torch.multiprocessing.spawn(_rank_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got.keys() == expected.keys()
        for k in expected:
            assert got[k] == pytest.approx(expected[k], abs=1e-6), (rank, k)


# ------------------------------------------------------------------ datasets
def test_gpqa_options_are_listed_and_shuffled_deterministically():
    from ngrpo_lightning.data.benchmarks import format_multiple_choice, gpqa_problem

    record = {
        "Question": "Which is a noble gas?",
        "Correct Answer": "Argon",
        "Incorrect Answer 1": "Iron",
        "Incorrect Answer 2": "Sodium",
        "Incorrect Answer 3": "Carbon",
    }
    p = gpqa_problem(record, "gpqa.jsonl:1", "gpqa-0")
    assert p.question.startswith("Which is a noble gas?\n\n(A) ")
    for letter, option in zip("ABCD", p.question.splitlines()[2:]):
        assert option.startswith(f"({letter}) ")
    assert f"({p.answer}) Argon" in p.question
    assert gpqa_problem(dict(record), "x", "y").question == p.question  # same order every time
    golds = {format_multiple_choice(f"Q{i}", "right", ["w1", "w2", "w3"])[1] for i in range(40)}
    assert golds == set("ABCD")  # the correct option is not always in the same place
    with pytest.raises(KeyError, match=r"gpqa.jsonl:3: field 'Incorrect Answer 2' \(GPQA format\) is missing"):
        gpqa_problem({k: v for k, v in record.items() if k != "Incorrect Answer 2"}, "gpqa.jsonl:3", "g")


def test_benchmark_missing_answer_field_names_field_and_file(tmp_path):
    from omegaconf import OmegaConf

    from ngrpo_lightning.data import MissingFieldError
    from ngrpo_lightning.data.benchmarks import load_benchmark

    f = tmp_path / "aime.jsonl"
    f.write_text(json.dumps({"problem": "1+1?", "solution": "2"}) + "\n")
    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "conf", "data", "aime24.yaml"))
    cfg.path = str(f)
    with pytest.raises(MissingFieldError, match=r"aime\.jsonl:1: field 'answer' \(data\.answer_field\) is missing"):
        load_benchmark(cfg)
    f.write_text(json.dumps({"problem": "1+1?", "answer": 2.0}) + "\n")
    assert [(p.question, p.answer) for p in load_benchmark(cfg)] == [("1+1?", "2")]


# ------------------------------------------------------------------ callback
def test_callback_logs_metrics_that_model_checkpoint_monitors(tiny, tmp_path):
    import lightning as L
    from conftest import ScriptedReward, fresh_store, tiny_rl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import MLFlowLogger

    from ngrpo_lightning.callbacks import PassAtK as PassAtKCallback
    from ngrpo_lightning.data import reasoning_gym_problems

    module, datamodule = tiny_rl(tiny, ScriptedReward((1, 0)))  # every problem: 1 of its 2 samples correct
    problems = reasoning_gym_problems(["chain_sum"], 2, seed=0, split="validation")
    evaluator = PassAtKCallback({"arith": problems}, n=2, every_n_steps=1, max_new_tokens=3, temperature=1.0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/arith/pass@2", mode="max", every_n_train_steps=1)
    logger = MLFlowLogger(
        experiment_name="t",
        tracking_uri=fresh_store(tmp_path / "mlflow.db"),
        artifact_location=(tmp_path / "artifacts").as_uri(),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[evaluator, ckpt],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=datamodule)

    assert [h["step"] for h in evaluator.history] == [1, 2]
    m = evaluator.history[-1]["metrics"]
    assert m["val/arith/pass@1"] == pytest.approx(0.5) and m["val/arith/pass@2"] == pytest.approx(1.0)
    assert m["val/arith/mean@2"] == pytest.approx(0.5) and m["val/avg/pass@2"] == pytest.approx(1.0)
    assert float(trainer.callback_metrics["val/arith/pass@2"]) == pytest.approx(1.0)
    assert ckpt.best_model_path and os.path.isfile(ckpt.best_model_path)
    assert float(ckpt.best_model_score) == pytest.approx(1.0)

    client = logger.experiment
    history = client.get_metric_history(logger.run_id, "val/arith/pass_at_2")
    assert [h.step for h in history] == [1, 2]
    files = {a.path for a in client.list_artifacts(logger.run_id, "pass_at_k/step_000002")}
    assert files == {f"pass_at_k/step_000002/{f}" for f in ("pass_at_k.md", "pass_at_k.png", "results.json")}
    table = (
        evaluator.last_results
        and open(client.download_artifacts(logger.run_id, "pass_at_k/step_000002/pass_at_k.md")).read()
    )
    assert "| Dataset | Mean@2 | Pass@1 | Pass@2 |" in table and "| arith | 50.0 | 50.0 | 100.0 |" in table
    per_problem = json.load(open(client.download_artifacts(logger.run_id, "pass_at_k/step_000002/results.json")))
    assert [(p["n"], p["c"]) for p in per_problem["sets"]["arith"]["problems"]] == [(2, 1), (2, 1)]


def test_callback_rejects_k_larger_than_n():
    from ngrpo_lightning.callbacks import PassAtK as PassAtKCallback
    from ngrpo_lightning.data import Problem

    with pytest.raises(ValueError, match="k=16 with n=8"):
        PassAtKCallback({"x": [Problem("0", "1+1?", "2")]}, n=8, ks=[1, 16])
