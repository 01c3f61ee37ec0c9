"""reasoning-gym tasks as data: seeded problems, disjoint splits, each task's own verifier in the
reward workers, bad task names and settings refused, and train / eval / diagnose on them."""

import json

import pytest

from ngrpo_lightning.build.data import build_problems
from ngrpo_lightning.commands.cli import main
from ngrpo_lightning.config import ConfigError, compose
from ngrpo_lightning.data import reasoning_gym_problems
from ngrpo_lightning.rewards import MathReward

MIX = [{"name": "chain_sum", "config": {"max_terms": 3}}, {"name": "basic_arithmetic", "weight": 2}]


@pytest.fixture(scope="module")
def rewards():
    """``(graded, binary)``: the reward with a task verifier's partial scores kept, and the default's
    (binary) scoring; one worker each, started once for the module's tests (each start imports math-verify)."""
    with (
        MathReward(extract="boxed", num_workers=1, graded=True) as graded,
        MathReward(extract="boxed", num_workers=1) as binary,
    ):
        yield graded, binary


def test_problems_are_reproducible_by_seed():
    a, b = reasoning_gym_problems(MIX, 60, seed=3), reasoning_gym_problems(MIX, 60, seed=3)
    assert [p.to_dict() for p in a] == [p.to_dict() for p in b]
    assert [p.question for p in a] != [p.question for p in reasoning_gym_problems(MIX, 60, seed=4)]


def test_train_and_validation_are_disjoint_and_mixed_by_weight():
    train = reasoning_gym_problems(MIX, 600, seed=0)
    val = reasoning_gym_problems(MIX, 60, seed=0, split="validation")
    assert not {p.question for p in train} & {p.question for p in val}
    assert len({p.question for p in val}) == 60  # validation problems are distinct
    basic = sum(p.meta["source"] == "reasoning_gym:basic_arithmetic" for p in train)
    assert {p.meta["source"] for p in train} == {"reasoning_gym:chain_sum", "reasoning_gym:basic_arithmetic"}
    assert 0.58 < basic / 600 < 0.75  # weight 2 of 3: 0.667, binomial sd 0.019
    assert all(json.loads(p.meta["verifier"])["answer"] == p.answer for p in train)


def test_the_shipped_config_draws_its_sizes_and_the_seed_moves_them():
    cfg = compose(["data=reasoning_gym", "data.train_size=50", "data.val_size=8"])
    train, val = build_problems(cfg.data, 0)
    assert (len(train), len(val)) == (50, 8)
    assert [p.question for p in build_problems(cfg.data, 1)[1]] != [p.question for p in val]


@pytest.mark.parametrize("task", ["chain_sum", "basic_arithmetic", "spell_backward", "word_sorting"])
def test_gold_answers_score_1_and_wrong_ones_do_not_under_the_tasks_verifier(task, rewards):
    graded, binary = rewards
    problems = reasoning_gym_problems([task], 6, seed=1, split="validation")
    golds, specs = [p.answer for p in problems], [p.meta["verifier"] for p in problems]
    texts = [f"Thinking... so \\boxed{{{g}}}" for g in golds] + [f"\\boxed{{{g}9}}" for g in golds]
    out = graded(texts, golds * 2, specs * 2)
    assert out.status[:6] == ["correct"] * 6 and out.scores[:6].tolist() == [1.0] * 6
    assert out.status[6:] == ["wrong"] * 6 and out.scores[6:].max() < 1.0  # some tasks grade near misses
    assert binary(texts[6:], golds, specs).scores.tolist() == [0.0] * 6


def test_chain_sum_grades_near_misses_and_binary_scoring_drops_them(rewards):
    """chain_sum's own checker gives partial credit to a near miss: the training reward keeps it
    (reward.graded=true), accuracy never counts it; binary scoring (the default) gives it 0."""
    (p,) = reasoning_gym_problems(["chain_sum"], 1, seed=0)
    texts = [f"\\boxed{{{p.answer}0}}", "\\boxed{-999999}"]  # the gold inside a longer answer: partial credit
    graded, binary = rewards
    out = graded(texts, [p.answer] * 2, [p.meta["verifier"]] * 2)
    assert 0.0 < out.scores[0] < 1.0 and out.scores[1] == 0.0 and not out.correct.any()
    assert binary(texts, [p.answer] * 2, [p.meta["verifier"]] * 2).scores.tolist() == [0.0, 0.0]


def test_math_verify_option_checks_the_gold_with_math_verify(rewards):
    (p,) = reasoning_gym_problems(["chain_sum"], 1, seed=0, verifier="math_verify")
    assert "verifier" not in p.meta
    _, binary = rewards
    out = binary([f"\\boxed{{{p.answer}.0}}", "\\boxed{-1e9}"], [p.answer] * 2)
    assert out.status == ["correct", "wrong"]  # 12.0 equals 12 for math-verify


@pytest.mark.parametrize(
    "tasks, match",
    [
        (
            ["chain_sums"],
            r"data\.tasks\[0\]\.name='chain_sums' is not a reasoning-gym task; did you mean \['chain_sum'",
        ),
        (["nonsense_task"], r"Allowed: \[.*'basic_arithmetic'.*'chain_sum'"),
        (
            [{"name": "chain_sum", "config": {"max_term": 3}}],
            r"\['max_term'\] are not settings of 'chain_sum'.*'max_terms'",
        ),
        ([{"name": "chain_sum", "weight": 0}], r"data\.tasks\[0\]\.weight=0 is out of range"),
        (["chain_sum", {"name": "chain_sum"}], r"names a task twice"),
        ([{"name": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}}], r"is not valid for 'chain_sum'"),
    ],
)
def test_bad_tasks_are_refused_with_what_is_allowed(tasks, match):
    cfg = compose(["data=reasoning_gym", "data.train_size=4", "data.val_size=0"])
    cfg.data.tasks = tasks
    with pytest.raises(ConfigError, match=match):
        build_problems(cfg.data, 0)


def test_a_task_with_too_few_distinct_questions_says_so():
    tasks = [{"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}]
    with pytest.raises(ValueError, match=r"cannot draw 500 distinct validation problems.*lower data\.val_size"):
        reasoning_gym_problems(tasks, 500, seed=0, split="validation")


def test_train_eval_and_diagnose_run_on_reasoning_gym(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    common = ["model=tiny", "data=reasoning_gym", "data.val_size=2", "reward.num_workers=1"]
    assert (
        main(
            ["train", *common, "trainer.max_steps=1", "data.train_size=8", "data.prompts_per_step=2"]
            + ["rollout.group_size=2", "rollout.max_new_tokens=6", "logger=none", f"output_dir={tmp_path}/train"]
        )
        == 0
    )
    assert "validation accuracy:" in capsys.readouterr().out
    out = tmp_path / "eval"
    assert main(["eval", *common, "n=2", "max_new_tokens=4", "logger=none", f"output_dir={out}"]) == 0
    problems = json.loads((out / "results.json").read_text())["sets"]["reasoning_gym"]["problems"]
    assert len(problems) == 2 and all(p["n"] == 2 for p in problems)
    assert (
        main(["diagnose", "rollouts", *common, "logger=none", f"output_dir={tmp_path}/diag"] + ["limit=2", "G=2"]) == 0
    )
