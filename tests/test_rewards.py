"""Rewards: answer extraction, math-verify equivalence, and what the reward returns and refuses.
The process pool's time limits and lifecycle: test_reward_pool.py."""

import pytest

from ngrpo_lightning import rewards
from ngrpo_lightning.rewards import extract_answer, verify_answer

TIMEOUT_S = 1.0
GRACE_S = 1.0


@pytest.fixture(scope="module")
def reward():
    with rewards.MathReward(timeout_s=TIMEOUT_S, num_workers=2, kill_grace_s=GRACE_S) as r:
        yield r


# ----------------------------------------------------------------- extraction
@pytest.mark.parametrize(
    "text,expected",
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}"),
        (r"first \boxed{1}, then \boxed{2}", "2"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not count
        (r"\fbox{7}", "7"),
        (r"\boxed 42 is it", "42"),
        ("no box here, just 12", None),
        (r"\boxed{}", None),
        (r"\boxed{1} then the final \boxed{2", None),  # truncated last box: no final answer
        (r"\fboxsep=3pt", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_answer(text) == expected
    assert extract_answer(text, "boxed") == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so 10-3 = 7.", "7"),
        ("total: 1,234 apples", "1234"),
        ("it is -0.25", "-0.25"),
        ("x-5", "5"),  # a binary minus is not a sign
        ("no numbers", None),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_answer(text, "last_number") == expected


def test_extract_unknown_method_names_key_and_choices():
    with pytest.raises(ValueError, match=r"reward\.extract.*boxed.*last_number"):
        extract_answer("x", "first_number")


# --------------------------------------------------------------- verification
@pytest.mark.parametrize(
    "pred,gold",
    [
        ("12", "12"),
        ("12.0", "12"),
        ("12", "12.0"),
        ("1/2", r"\frac{1}{2}"),
        (r"\frac{1}{2}", "0.5"),
        ("0.5", "1/2"),
        (r"\dfrac12", "0.5"),
        (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"),
        ("1,000", "1000"),
        ("x = 12", "12"),
        (r"10\%", r"10\%"),
        ("B", "B"),
        ("(B)", "B"),
        ("B", "(B)"),
        (r"\text{(B)}", "B"),
        ("b", "B"),
    ],
)
def test_verify_equal(pred, gold):
    assert verify_answer(pred, gold)


@pytest.mark.parametrize(
    "pred,gold",
    [
        ("13", "12"),
        ("-12", "12"),
        ("0.51", "1/2"),
        ("C", "B"),
        ("(C)", "B"),
        (r"\sqrt{-1}", "I"),  # a choice letter is a letter, not the imaginary unit
        ("", "12"),
        (None, "12"),
    ],
)
def test_verify_not_equal(pred, gold):
    assert not verify_answer(pred, gold)


# --------------------------------------------------------------------- reward
def test_reward_scores_and_status(reward):
    res = reward(
        [r"\boxed{4}", r"\boxed{5}", "I don't know", r"\boxed{\frac{1}{2}}", r"\boxed{(B)}"],
        ["4", "4", "4", "0.5", "B"],
    )
    assert isinstance(res, rewards.RewardResult)
    assert res.status == ["correct", "wrong", "no_answer", "correct", "correct"]
    assert str(res.scores.dtype) == "torch.float32"
    assert res.scores.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert res.answers[2] is None and res.worker_pids[2] == 0
    assert res.counts() == {"correct": 3, "wrong": 1, "no_answer": 1, "timeout": 0, "error": 0}
    m = res.metrics()
    assert m["reward/correct_frac"] == pytest.approx(0.6)
    assert m["reward/no_answer_frac"] == pytest.approx(0.2)
    assert m["reward/timeout_frac"] == 0.0 and set(m) == {f"reward/{s}_frac" for s in res.counts()}


def test_reward_empty_and_mismatch(reward):
    res = reward([], [])
    assert res.scores.shape == (0,) and res.status == [] and res.metrics()["reward/timeout_frac"] == 0.0
    with pytest.raises(ValueError, match="3 completions but 2 gold"):
        reward(["a", "b", "c"], ["1", "2"])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"extract": "first"}, r"reward\.extract"),
        ({"timeout_s": 0}, r"reward\.timeout_s"),
        ({"num_workers": 0}, r"reward\.num_workers"),
        ({"parallel_threshold": -1}, r"reward\.parallel_threshold"),
    ],
)
def test_reward_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rewards.MathReward(**kwargs)


def test_check_fn_must_be_picklable():
    with pytest.raises(TypeError, match="picklable"):
        rewards.MathReward(check_fn=lambda p, g: True)


def test_answer_after_reads_the_answer_after_the_reasoning():
    """reward.answer_after='</think>': the \\boxed{} of the thinking does not count; without the
    marker (the model never stopped thinking) there is no answer."""
    with rewards.MathReward(answer_after="</think>", num_workers=1) as r:
        res = r(
            [
                r"maybe \boxed{3}</think>So the answer is \boxed{4}.",
                r"I think \boxed{4} but</think> it is \boxed{5}",
                r"still thinking \boxed{4}",
                r"a</think>b</think> \boxed{4}",  # the last marker counts
            ],
            ["4", "4", "4", "4"],
        )
    assert res.status == ["correct", "wrong", "no_answer", "correct"]
    with rewards.MathReward(num_workers=1) as whole:
        assert whole([r"I think \boxed{4} but</think> it is \boxed{5}"], ["4"]).status == ["wrong"]
    with pytest.raises(ValueError, match=r"reward\.answer_after"):
        rewards.MathReward(answer_after="")


def test_a_batch_the_verifier_mostly_failed_on_is_refused_not_trained_on():
    """Status 'error' is a broken check, not a wrong answer: a batch where most answers got it
    stops the run with what to fix (a sweep once trained a whole run on such zeros)."""
    import torch

    from ngrpo_lightning.rewards.reward import RewardResult, score_responses

    def broken(completions, golds):
        status = ["error"] * 3 + ["correct", "no_answer"]
        return RewardResult(torch.zeros(5), status[: len(completions)])

    with pytest.raises(RuntimeError, match=r"the verifier failed on 3 of 4 answers .*resume=last"):
        score_responses(broken, ["a"] * 5, ["1"] * 5)

    def one_error(completions, golds):
        return RewardResult(torch.zeros(4), ["error", "wrong", "correct", "wrong"])

    assert score_responses(one_error, ["a"] * 4, ["1"] * 4).status[0] == "error"  # one failure: the step goes on
