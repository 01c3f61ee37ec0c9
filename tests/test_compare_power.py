"""What `ngrpo compare` concludes, checked against sweeps simulated from known per-problem success
rates: the intervals' error rate, the minimum detectable difference, the plans, the verdicts, the
curve fits on curves of known parameters, and the posterior Pass@k."""

import dataclasses
import math

import numpy as np
import pytest

from ngrpo_lightning.commands.compare.curves import contrast, fit_arm, saturating
from ngrpo_lightning.commands.compare.posterior import (
    fit_hierarchical_prior,
    posterior_interval,
    ranking_changes,
)
from ngrpo_lightning.commands.compare.power import (
    _half_width,
    detection,
    joint_bound,
    mdd,
    plan_text,
    problems_needed,
    seeds_needed,
    seeds_to_conclude,
    verdict,
)
from ngrpo_lightning.commands.compare.sequential import steadiness, verdict_history
from ngrpo_lightning.commands.compare.stats import paired_differences, seed_interval
from ngrpo_lightning.metrics import pass_at_k, posterior_pass_at_k


def simulated_sweep(rng, delta: float, seeds: int, problems: int, n: int = 16, seed_sd: float = 0.04):
    """Per seed, the per-problem Pass@1 differences a - b of two arms: each seed draws its own
    problems (success rates from Beta(2, 5)), each arm a seed effect of sd ``seed_sd``, and arm a
    is ``delta`` better on every problem; n samples per problem and arm."""
    out = []
    for _ in range(seeds):
        rates = rng.beta(2, 5, problems)
        effect_a, effect_b = rng.normal(0, seed_sd, 2)
        a = rng.binomial(n, np.clip(rates + delta + effect_a, 0, 1)) / n
        b = rng.binomial(n, np.clip(rates + effect_b, 0, 1)) / n
        out.append(a - b)
    return out


def seen(d) -> bool:
    return d.low > 0 or d.high < 0


def pooled(found):
    """One detection whose variance components average many simulated sweeps' (the expected plan)."""
    return dataclasses.replace(
        found[0],
        var_seed=float(np.mean([d.var_seed for d in found])),
        var_problem=float(np.mean([d.var_problem for d in found])),
    )


@pytest.mark.parametrize("seeds, problems, seed_sd", [(3, 64, 0.04), (6, 64, 0.04), (10, 16, 0.04), (8, 64, 0.0)])
def test_the_stated_minimum_difference_is_detected_at_80_percent(seeds, problems, seed_sd):
    rng = np.random.default_rng(seeds * 100 + problems)
    # the difference a sweep of this design states, as the root mean square over 100 such sweeps
    stated = [detection(simulated_sweep(rng, 0.0, seeds, problems, seed_sd=seed_sd)).mdd for _ in range(100)]
    minimum = math.sqrt(np.mean(np.square(stated)))
    hits = [seen(detection(simulated_sweep(rng, minimum, seeds, problems, seed_sd=seed_sd))) for _ in range(400)]
    false = [seen(detection(simulated_sweep(rng, 0.0, seeds, problems, seed_sd=seed_sd))) for _ in range(400)]
    assert 0.72 <= np.mean(hits) <= 0.88  # 80% power, +- 4 binomial sd of 400 sweeps
    assert np.mean(false) <= 0.08  # the 95% interval excludes a true 0 about 5% of the time


def test_plans_reach_80_percent_with_the_seeds_or_problems_they_name():
    rng = np.random.default_rng(7)
    pilot = pooled([detection(simulated_sweep(rng, 0.0, 3, 64)) for _ in range(100)])
    seeds = seeds_needed(pilot, 0.06)
    assert 5 <= seeds <= 20 and mdd(pilot, seeds, 64) <= 0.06 < mdd(pilot, seeds - 1, 64)
    assert 0.72 <= np.mean([seen(detection(simulated_sweep(rng, 0.06, seeds, 64))) for _ in range(400)]) <= 0.88
    # little seed spread: more problems per seed do it at a fixed number of seeds ...
    pilot = pooled([detection(simulated_sweep(rng, 0.0, 8, 32, seed_sd=0.01)) for _ in range(100)])
    problems = problems_needed(pilot, 0.03)
    assert 32 < problems < 400
    hits = [seen(detection(simulated_sweep(rng, 0.03, 8, problems, seed_sd=0.01))) for _ in range(400)]
    assert 0.72 <= np.mean(hits) <= 0.92
    # ... a large one cannot be averaged away by problems
    pilot = pooled([detection(simulated_sweep(rng, 0.0, 3, 64, seed_sd=0.08)) for _ in range(50)])
    assert problems_needed(pilot, 0.03) is None and seeds_needed(pilot, 0.03) > 20


def test_seed_interval_uses_the_seeds_as_units():
    assert tuple(seed_interval([[0.5] * 10, [0.5] * 4])) == (0.5, 0.5, 0.5)  # no spread, no width
    means = [0.2, 0.4, 0.3]
    interval = seed_interval([[m - 0.1, m + 0.1] for m in means])
    assert interval.mean == pytest.approx(0.3) and interval.dof == 2 and interval.unit == "seeds"
    assert interval.se == pytest.approx(np.std(means, ddof=1) / math.sqrt(3))
    assert interval.high - interval.mean == pytest.approx(4.303 * interval.se, rel=1e-3)  # t(0.975, 2 dof)
    one = seed_interval([[0.0, 1.0, 0.0, 1.0]])  # one seed: its problems are the units
    assert one.unit == "problems" and one.dof == 3 and one.low < 0.5 < one.high
    assert math.isnan(seed_interval([]).mean)


def test_verdicts_name_the_winner_bound_the_difference_or_say_what_is_missing():
    rng = np.random.default_rng(3)
    clear = detection(simulated_sweep(rng, 0.15, 8, 64))
    found = verdict("grpo", "ngrpo", clear, 0.05)
    assert found["kind"] == "greater" and found["text"].startswith("grpo > ngrpo by ")
    flipped = dataclasses.replace(clear, diff=-clear.diff, low=-clear.high, high=-clear.low)
    assert verdict("ngrpo", "grpo", flipped, 0.05)["text"] == found["text"]  # the winner first, whichever side
    tight = detection(simulated_sweep(rng, 0.0, 20, 400, seed_sd=0.0))
    assert verdict("a", "b", tight, 0.05)["kind"] == "bounded"
    assert verdict("a", "b", tight, 0.05)["text"].startswith("no difference larger than ")
    loose = detection(simulated_sweep(rng, 0.0, 3, 16))
    text = verdict("a", "b", loose, 0.05)["text"]
    assert text.startswith("inconclusive [") and "seeds (or " in text and "would detect 5.0" in text
    alike = detection([[0.0] * 4, [0.0] * 4])  # both arms wrong on every problem: no spread, no bound
    found = verdict("a", "b", alike, 0.05)
    assert found["kind"] == "inconclusive" and "both arms scored alike on every problem" in found["text"]
    assert (
        math.isnan(alike.mdd)
        and plan_text(alike, 0.05) == "no plan: the paired differences have no spread to plan with"
    )
    assert plan_text(detection([]), 0.05) == "no plan: no problem evaluated by both arms"  # it divided by zero
    small = dataclasses.replace(loose, seeds=10, var_seed=0.0, var_problem=0.01)  # one problem a seed detects 50
    assert "(or 1 validation problem per seed at 10 seeds)" in plan_text(small, 0.5)


def test_a_saturating_fit_recovers_known_curves_and_tells_pace_from_ceiling():
    rng = np.random.default_rng(0)
    x = np.arange(0, 61, 3.0)

    def arm(midpoint, asymptote=0.6, seeds=6, upto=60):
        curve = lambda c: saturating(c, 0.2, asymptote, midpoint, 2.0)  # noqa: E731
        return [[(c, float(curve(c) + rng.normal(0, 0.02) * (c > 0))) for c in x if c <= upto] for _ in range(seeds)]

    fast, slow, low = fit_arm(arm(5)), fit_arm(arm(15)), fit_arm(arm(15, asymptote=0.45))
    covered = []
    for fit, truth in ((fast, (0.6, 5)), (slow, (0.6, 15)), (low, (0.45, 15))):
        for name, value in zip(("asymptote", "midpoint"), truth):
            assert getattr(fit, name) == pytest.approx(value, rel=0.1)
            covered.append(fit.intervals[name][0] <= value <= fit.intervals[name][1])
        assert fit.r0 == pytest.approx(0.2) and fit.ceiling_identified and fit.rmse < 0.03
    assert sum(covered) >= 5  # 95% intervals: one miss in six is allowed
    said = contrast("A", "B", fast, slow, "step")  # same ceiling, A three times faster
    assert said.startswith("ceilings not told apart; A reaches half its gain ") and said.endswith(
        "x sooner in optimizer steps"
    )
    assert 2.5 <= float(said.split("gain ")[1].split("x")[0]) <= 3.6
    assert contrast("B", "C", slow, low, "step") == "B has the higher ceiling; pace not told apart"
    short = fit_arm(arm(15, upto=6))  # the curve has not bent yet: pace only
    assert not short.ceiling_identified
    assert "a ceiling not reached within the runs" in contrast("A", "S", fast, short, "step")
    assert fit_arm([[(0, 0.2), (3, 0.3)]]) is None  # too few points


def test_holm_adjusts_a_family_and_the_t_test_p_value_matches_the_interval():
    from ngrpo_lightning.commands.compare.power import holm

    assert holm([0.01, 0.04, 0.03, float("nan")])[:3] == pytest.approx([0.03, 0.06, 0.06])
    assert math.isnan(holm([float("nan")])[0])
    rng = np.random.default_rng(5)
    for delta in (0.0, 0.05, 0.2):
        d = detection(simulated_sweep(rng, delta, 6, 64))
        assert (d.p_value < 0.05) == seen(d) and d.dof == 5  # p < 0.05 exactly when the 95% interval excludes 0


def test_posterior_pass_at_k():
    assert posterior_pass_at_k(16, 0, 1) == pytest.approx(1 / 18)  # Beta(1, 17): mean 1/18
    assert posterior_pass_at_k(4, 2, 2) == pytest.approx(1 - (3 / 6) * (4 / 7))
    assert posterior_pass_at_k(8, 8, 8) < 1.0 and posterior_pass_at_k(8, 0, 8) > 0.0  # never exactly 0 or 1
    assert posterior_pass_at_k(4, 1, 16) > 0  # defined for k > n
    assert abs(posterior_pass_at_k(4000, 1000, 4) - pass_at_k(4000, 1000, 4)) < 1e-3  # agree as n grows
    with pytest.raises(ValueError, match="prior"):
        posterior_pass_at_k(4, 1, 1, prior=(0, 1))
    mean, low, high = posterior_interval([[(16, 4), (16, 8)], [(16, 2)]], k=2, draws=20000)
    first = np.mean([posterior_pass_at_k(16, 4, 2), posterior_pass_at_k(16, 8, 2)])
    expected = np.mean([first, posterior_pass_at_k(16, 2, 2)])
    assert mean == pytest.approx(expected) and low < mean < high
    assert ranking_changes({"a": 0.5, "b": 0.4}, {"a": 0.3, "b": 0.35}) == [("a", "b")]
    # the prior fitted to the problems: Beta(2, 5) rates, 16 samples each
    rng = np.random.default_rng(0)
    rates = rng.beta(2, 5, 4000)
    a, b = fit_hierarchical_prior([(16, int(c)) for c in rng.binomial(16, rates)]).typical()
    assert a == pytest.approx(2, rel=0.2) and b == pytest.approx(5, rel=0.2)
    # with the fitted prior, 0 of 16 right on a task of hard problems is near 0 at Pass@16, not 48%
    hard = fit_hierarchical_prior([(16, 0)] * 90 + [(16, 16)] * 10)
    assert posterior_interval([[(16, 0)]], 16, prior=hard)[0] < 0.1 < 0.48 < posterior_pass_at_k(16, 0, 16)
    assert ranking_changes({"a": 0.5, "b": 0.4}, {"a": 0.5, "b": 0.4}) == []


def test_runs_whose_verifier_failed_are_left_out():
    from ngrpo_lightning.commands.compare.runs import RunData, broken_verifier_runs

    def run(errors):
        return RunData(
            "r",
            "arm",
            "0",
            "e",
            "FINISHED",
            {},
            0,
            curves={"reward/error_frac": [(i, 0.0, e) for i, e in enumerate(errors)]},
        )

    broken, fine = run([0.8, 0.9, 0.85]), run([0.0, 0.05, 0.0])
    assert broken_verifier_runs([broken, fine]) == [(broken, pytest.approx(0.85))]


def per_seed_scores(groups, metric="pass@1"):
    """Per-problem differences as the two arms' per-seed scores (b all 0, a the difference)."""
    a = {str(s): {f"p{i}": {metric: float(v)} for i, v in enumerate(g)} for s, g in enumerate(groups)}
    b = {str(s): {f"p{i}": {metric: 0.0} for i in range(len(g))} for s, g in enumerate(groups)}
    return a, b


def test_the_verdict_history_follows_the_seeds_in_order_and_says_since_when_it_held():
    rng = np.random.default_rng(11)
    # twelve seeds: the first three favour a by 30 points, the next three b, the rest neither
    shift = [0.3] * 3 + [-0.3] * 3 + [0.0] * 6
    groups = [g + shift[s] for s, g in enumerate(simulated_sweep(rng, 0.0, 12, 64, seed_sd=0.0))]
    a, b = per_seed_scores(groups)
    history = verdict_history(a, b, "pass@1", 0.05)
    assert [h["seeds"] for h in history] == list(range(2, 13))  # seeds "10", "11" after "9", not after "1"
    assert history[0]["kind"] == "greater" and history[0]["low"] > 0  # two seeds: both favour a
    whole = detection(paired_differences(a, b, "pass@1"))
    assert (history[-1]["diff"], history[-1]["low"]) == pytest.approx((whole.diff, whole.low))
    assert history[-1]["kind"] == verdict("a", "b", whole, 0.05)["kind"] != "greater"
    steady = steadiness(history)
    kinds = [h["kind"] for h in history]
    assert steady["changes"] >= 1 and steady["held_since"] > 2
    since = steady["held_since"] - 2  # history[i] is on i + 2 seeds
    assert all(k == kinds[-1] for k in kinds[since:]) and kinds[since - 1] != kinds[-1]
    # a winner that turns counts as a change; no history, no verdict
    turn = [{"seeds": 2, "kind": "greater", "low": 0.1}, {"seeds": 3, "kind": "greater", "low": -0.3}]
    assert steadiness(turn) == {"held_since": 3, "changes": 1}
    assert steadiness([]) == {"held_since": None, "changes": 0}


def test_reading_the_verdict_after_every_seed_errs_far_more_often_than_its_level():
    """Optional stopping, the reason the report shows the history: with no true difference, the
    interval excludes 0 at some number of seeds from 2 to 20 far more often than 5%."""
    rng = np.random.default_rng(5)
    anywhere, at_the_end = [], []
    for _ in range(200):
        groups = simulated_sweep(rng, 0.0, 20, 32)
        seen_along = [seen(detection(groups[:n])) for n in range(2, 21)]
        anywhere.append(any(seen_along))
        at_the_end.append(seen_along[-1])
    assert np.mean(at_the_end) <= 0.1 and np.mean(anywhere) >= 0.15


def test_how_far_an_inconclusive_sweep_is_from_a_verdict_at_its_estimate():
    rng = np.random.default_rng(21)
    found = detection(simulated_sweep(rng, 0.0, 10, 64))
    width = lambda d, s: _half_width(d, s)  # noqa: E731
    for diff in (0.01, 0.025, 0.04):
        d = dataclasses.replace(found, diff=-diff)
        bound, show = seeds_to_conclude(d, 0.05)
        assert diff + width(d, bound) <= 0.05 < diff + width(d, bound - 1)  # the fewest that bound it
        assert width(d, show) < diff <= width(d, show - 1)  # the fewest that exclude 0
    assert seeds_to_conclude(dataclasses.replace(found, diff=0.06), 0.05)[0] is None  # past the target: never bounded
    assert seeds_to_conclude(dataclasses.replace(found, diff=0.0), 0.05)[1] is None  # nothing to show
    # a smaller estimate is bounded sooner and shown later
    near, far = (seeds_to_conclude(dataclasses.replace(found, diff=x), 0.05) for x in (0.01, 0.04))
    assert near[0] < far[0] and near[1] > far[1]
    text = verdict("a", "b", dataclasses.replace(found, diff=-0.025, low=-0.08, high=0.03), 0.05)["text"]
    assert text.startswith("inconclusive [-8.0, +3.0]") and "at the estimate of -2.5, about " in text


def test_the_joint_bound_widens_every_interval_so_that_all_hold_at_once():
    rng = np.random.default_rng(8)
    found = [detection(simulated_sweep(rng, 0.0, 12, 64)) for _ in range(6)]
    alone = [max(abs(d.low), abs(d.high)) for d in found]
    assert joint_bound(found[:1]) == pytest.approx(alone[0])  # one comparison: its own interval
    assert joint_bound(found) > max(alone)
    # six true differences of 5 points: the joint bound falls short of 5 in at most about 5% of families
    short = [joint_bound([detection(simulated_sweep(rng, 0.05, 8, 32)) for _ in range(6)]) < 0.05 for _ in range(200)]
    assert np.mean(short) <= 0.05
    assert math.isnan(joint_bound([]))


@pytest.mark.parametrize("rate", [0.005, 0.05, 0.5])
def test_posterior_pass_at_k_holds_its_coverage_and_tracks_the_observed_rate_at_any_accuracy(rate):
    """Simulated sweeps of one arm (3 seeds x 40 problems x 4 samples, the problems' true rates
    spread around ``rate``): the 95% posterior interval of Pass@1 and Pass@4 holds the arm's true
    value (the mean over its problems) in at least 93% of sweeps, and the posterior mean of Pass@1
    stays near the observed rate. A uniform prior put an arm at 0.3% observed at 17%; a single prior
    fitted by moments covered 65-82% of sweeps here."""
    rng = np.random.default_rng(int(rate * 1000))
    sweeps, covered, gaps = 600, {1: 0, 4: 0}, []
    for _ in range(sweeps):
        rates = [rng.beta(4 * rate, 4 * (1 - rate), 40) for _ in range(3)]
        per_seed = [[(4, int(c)) for c in rng.binomial(4, p)] for p in rates]
        prior = fit_hierarchical_prior([x for seed in per_seed for x in seed])
        for k in covered:
            mean, low, high = posterior_interval(per_seed, k, draws=500, seed=int(rng.integers(1 << 30)), prior=prior)
            truth = float(np.mean([np.mean(1 - (1 - p) ** k) for p in rates]))
            covered[k] += low <= truth <= high
            if k == 1:
                observed = np.mean([np.mean([c / n for n, c in seed]) for seed in per_seed])
                gaps.append(abs(mean - observed))
    for k, hits in covered.items():
        assert hits / sweeps >= 0.93, (k, hits / sweeps)
    assert np.mean(gaps) <= 0.2 * rate + 0.002, np.mean(gaps)


def test_rates_stay_inside_0_and_1_and_a_verdict_without_spread_is_a_whole_sentence_with_no_plan():
    """An arm near 0% over 3 seeds: its t interval is cut at 0 (a rate cannot be negative; the truth
    is never cut off). Two arms that score alike on every problem: the verdict is inconclusive, in a
    whole sentence, and neither the plan nor the projection names a number of seeds."""
    near_zero = seed_interval([[0.0] * 20, [0.0] * 19 + [1.0], [0.0] * 20], bounds=(0.0, 1.0))
    assert near_zero.low == 0.0 and 0 < near_zero.mean < near_zero.high <= 1.0
    assert seed_interval([[0.0] * 20, [0.0] * 19 + [1.0], [0.0] * 20]).low < 0  # without bounds: below 0
    alike = detection([[0.0] * 6, [0.0] * 6])
    said = verdict("a", "b", alike, 0.05)
    assert said["kind"] == "inconclusive" and said["text"].endswith("can bound one.")
    assert plan_text(alike, 0.05).startswith("no plan")
    assert seeds_to_conclude(alike, 0.05) == (None, None)
    assert math.isnan(joint_bound([]))
