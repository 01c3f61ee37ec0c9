"""Rollouts ahead of training (``train.max_staleness``): the first batch equals an on-policy
run's, each batch's weights are exactly as old as the bound allows, the importance weights see
the stale policy, ``resume=last`` continues exactly with rollouts in flight, and configurations
that cannot run it are refused before a model loads."""

import pytest
import torch
from conftest import ScriptedReward
from test_resume import KEYS, history, run, weights

from ngrpo_lightning.checkpoints.safe_load import load_checkpoint
from ngrpo_lightning.commands.cli import train
from ngrpo_lightning.config import ConfigError, compose

UPDATES = 2  # test_resume's RUN: 2 optimizer updates per rollout batch


@pytest.fixture(autouse=True)
def scripted_reward(monkeypatch):
    """Rows alternate reward 1/0 (real advantages, real updates) whatever the model writes."""
    monkeypatch.setattr("ngrpo_lightning.build.components.build_reward", lambda cfg: ScriptedReward((1, 0)))


def values(tmp, run_id, key):
    return [v for _, v in history(tmp, run_id, key)]


def test_first_batch_equals_on_policy_and_later_ones_are_stale(tmp_path):
    """Batch 0 of a run with max_staleness=1 comes from the worker's copy of the initial weights:
    the same rollouts, losses and gradients as the on-policy run. Batch 1 is rolled out while
    batch 0 trains, from the initial weights: it differs from the on-policy run's."""
    on = run(tmp_path / "on", "out", "trainer.max_steps=4")
    ahead = run(tmp_path / "ahead", "out", "trainer.max_steps=4", "train.max_staleness=1")
    for key in KEYS:
        a, b = values(tmp_path / "on", on["run_id"], key), values(tmp_path / "ahead", ahead["run_id"], key)
        assert a[0] == pytest.approx(b[0], rel=1e-6, abs=1e-7), key
    loss_on = values(tmp_path / "on", on["run_id"], "train/loss")
    loss_ahead = values(tmp_path / "ahead", ahead["run_id"], "train/loss")
    assert loss_on[1] != pytest.approx(loss_ahead[1], rel=1e-4)
    # the stale batch is corrected: its importance weights are not all 1
    weights = values(tmp_path / "ahead", ahead["run_id"], "train/tis_weight_max")
    assert weights[0] == pytest.approx(1.0, abs=1e-4) and weights[1] != pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("explorer, objective", [("neighbor", "gspo"), ("temperature", "grpo")])
def test_each_batch_uses_weights_exactly_as_old_as_the_bound(tmp_path, explorer, objective):
    """Batch b is rolled out with the weights after batch max(0, b - k): versions counted in
    optimizer steps, never older than k batches; the waits of both sides are logged."""
    k = 2
    summary = run(
        tmp_path, "out", "trainer.max_steps=10", f"train.max_staleness={k}", f"explorer={explorer}",
        f"objective={objective}", "replay.capacity=0",
    )  # fmt: skip
    versions = values(tmp_path, summary["run_id"], "async/weights_version")
    staleness = values(tmp_path, summary["run_id"], "async/staleness")
    assert versions == [UPDATES * max(0, b - k) for b in range(5)]
    assert staleness == [UPDATES * b - UPDATES * max(0, b - k) for b in range(5)]
    assert max(staleness) <= UPDATES * k
    got = {
        key: values(tmp_path, summary["run_id"], key)
        for key in ("async/trainer_wait_s", "async/generator_wait_s", "train/tis_clipped_frac", "train/tis_weight_mean")
    }
    step_s = values(tmp_path, summary["run_id"], "time/step_s")
    assert all(w >= 0 for w in got["async/trainer_wait_s"] + got["async/generator_wait_s"])
    assert sum(got["async/trainer_wait_s"]) < sum(step_s)  # the trainer waits inside its steps
    assert all(0 <= f <= 1 for f in got["train/tis_clipped_frac"])
    assert all(0 < w <= 2.0 for w in got["train/tis_weight_mean"])  # capped at 2.0 under max_staleness
    # the batches rolled out by older weights are reweighted: their mean weight is not 1
    assert any(abs(w - 1) > 1e-6 for w in got["train/tis_weight_mean"][k:])


def test_resumed_run_with_rollouts_in_flight_equals_uninterrupted(tmp_path):
    """A checkpoint holds the rollouts queued ahead (and the worker's RNG after them): resuming
    a 4-batch run from its checkpoint after batch 3, with batch 4 in flight, gives the same
    steps and weights again (replay buffer and shuffled data included)."""
    extra = ("trainer.max_steps=8", "train.max_staleness=1", "checkpoint.every_n_steps=6", "checkpoint.keep=-1")
    whole = run(tmp_path, "out", *extra)
    expected = {key: values(tmp_path, whole["run_id"], key) for key in KEYS + ["async/staleness"]}
    final = weights(tmp_path / "out/checkpoints/last.ckpt")
    step6 = tmp_path / "out/checkpoints/step-6.ckpt"
    in_flight = load_checkpoint(step6, mmap=False)["RolloutDataModule"]["ahead"][0]["ready"]
    assert list(in_flight) == [(1, 0)]  # batch 4: the first of the second pass over the data's 3 batches
    resumed = run(tmp_path, "out", *extra, f"resume={step6}")
    assert resumed["run_id"] == whole["run_id"]
    for key, before in expected.items():
        assert values(tmp_path, whole["run_id"], key) == pytest.approx(before, rel=1e-5, abs=1e-6), key
    assert expected["async/staleness"] == [0, 2, 2, 2]
    again = weights(tmp_path / "out/checkpoints/last.ckpt")
    for name in final:
        torch.testing.assert_close(again[name], final[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.max_staleness=-1"], r"train.max_staleness=-1 is out of range"),
        (["rollout.ahead_threads=2"], r"unknown config key 'rollout.ahead_threads'"),  # the backend's now
        (["objective=gspo", "train.tis_level=token"], "train.tis_level=token needs an objective"),
    ],
)
def test_staleness_that_cannot_run_is_refused_before_the_model_loads(tmp_path, overrides, message, monkeypatch):
    monkeypatch.setattr(
        "ngrpo_lightning.build.components.load_policy", lambda *a, **k: pytest.fail("the model was loaded")
    )
    with pytest.raises((ConfigError, ValueError), match=message):
        train(compose(["model=tiny", "train.max_staleness=1", f"output_dir={tmp_path}", *overrides]))


def test_the_workers_threads_are_the_backends_unless_given(tiny):
    """The worker's intra-op threads: the module's backend's ``ahead_threads``, or the DataModule's
    own ``ahead_threads`` where one is given (checked)."""
    from types import SimpleNamespace

    from conftest import tiny_rl

    from ngrpo_lightning.rollout import RolloutDataModule

    with pytest.raises(ValueError, match=r"ahead_threads=0 is out of range"):
        RolloutDataModule(tiny[1], [], [], prompts_per_step=2, group_size=2, max_new_tokens=6, ahead_threads=0)
    for given, expected in ((None, 2), (3, 3)):
        module, dm = tiny_rl(tiny, ScriptedReward([1]))
        module.backend.ahead_threads = 2
        dm.ahead_threads = given
        dm.trainer = SimpleNamespace(lightning_module=module)
        try:
            assert dm.ensure_ahead().threads == expected
        finally:
            dm.close_ahead()


def test_dynamic_sampling_draws_its_extra_rollouts_from_the_worker(tiny):
    """Under max_staleness the worker owns the training explorer and the engine's generator: a
    step's extra rollouts (DAPO) are rolled out there, after the queued batches, with the
    current weights (staleness 0), and the step trains on the refilled batch."""
    from conftest import tiny_rl, tiny_trainer

    # batch 0: group 0 all wrong, group 1 mixed; its extra batch: both mixed; batch 1 likewise
    reward = ScriptedReward([0, 0, 1, 0], [1, 0, 1, 0], [0, 0, 1, 0], [1, 0, 1, 0])
    module, dm = tiny_rl(tiny, reward, num_problems=6, dynamic_sampling=True)
    dm.max_staleness = 1
    extra = []
    original = dm.more_rollouts
    dm.more_rollouts = lambda: extra.append(original()) or extra[-1]
    trainer = tiny_trainer(max_steps=2)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2 and len(extra) == 2
    assert [batch.stats["async/staleness"] for batch in extra] == [0.0, 0.0]
    assert [batch.stats["async/weights_version"] for batch in extra] == [0.0, 1.0]
    assert trainer.callback_metrics["dynamic/kept_groups"] == 2
    assert dm.extra_prompts_drawn == 4 and dm.ahead is None  # the worker stopped with fit


def test_worker_of_a_lora_policy_shares_its_base_and_decodes_what_it_does(tokenizer):
    """The worker's copy of a LoRA policy shares the frozen base weights (no second copy) and
    has adapters of its own, set from each job's weights: its rollouts equal the policy's own
    (same seed), before and after the policy's adapters change."""
    from conftest import chat_prompt_ids, trained_lora

    from ngrpo_lightning.explorers import TemperatureExplorer
    from ngrpo_lightning.rollout import HFEngine
    from ngrpo_lightning.rollout.ahead import RolloutsAhead
    from ngrpo_lightning.rollout.worker_copy import trainable_snapshot

    policy = trained_lora()
    tok = tokenizer
    prompts = chat_prompt_ids(tok, ["What is 2 + 3?", "What is 7 - 4?"])
    make = lambda model: HFEngine(model, tok, max_new_tokens=8, seed=3)  # noqa: E731
    ahead, reference = RolloutsAhead(policy, make, threads=1), make(policy)
    try:
        worker = dict(ahead.model.named_parameters())
        for name, p in policy.named_parameters():
            shared = worker[name].data_ptr() == p.data_ptr()
            assert shared == (not p.requires_grad), name  # base shared, adapters copied
        for version in (0, 1):
            explorer = TemperatureExplorer(temperature=1.0)
            job = lambda engine, e=explorer: engine.generate(prompts, e, n=2)  # noqa: E731
            ahead.submit((0, version), job, trainable_snapshot(policy), version)
            got = ahead.take((0, version))
            want = reference.generate(prompts, TemperatureExplorer(temperature=1.0), n=2)
            assert torch.equal(got.response_ids, want.response_ids)
            torch.testing.assert_close(got.rollout_logprobs, want.rollout_logprobs, rtol=0, atol=1e-6)
            with torch.no_grad():  # an optimizer step: the adapters change, the worker's do not until its next job
                for p in policy.parameters():
                    if p.requires_grad:
                        p.add_(0.05 * torch.randn_like(p))
            adapter = next(n for n, p in policy.named_parameters() if p.requires_grad)
            assert not torch.equal(worker[adapter], dict(policy.named_parameters())[adapter])
    finally:
        ahead.close()


def test_a_rollout_in_flight_saved_with_other_noise_is_made_again(tiny, caplog):
    """A checkpoint's rollout in flight whose noise an earlier version made (another generator)
    is dropped on restore, said in the log, and made again when its step asks for it."""
    from conftest import chat_prompt_ids

    from ngrpo_lightning.explorers import GaussianNoiseExplorer
    from ngrpo_lightning.rollout import HFEngine
    from ngrpo_lightning.rollout.ahead import RolloutsAhead
    from ngrpo_lightning.rollout.worker_copy import trainable_snapshot

    model, tok = tiny
    prompts = chat_prompt_ids(tok, ["What is 2 + 3?"])
    ahead = RolloutsAhead(model, lambda m: HFEngine(m, tok, max_new_tokens=4, seed=0), threads=1)
    try:
        job = lambda engine: engine.generate(prompts, GaussianNoiseExplorer(), n=2)  # noqa: E731
        ahead.submit((0, 0), job, trainable_snapshot(model), 0)
        saved = ahead.state_dict()
        assert saved["ready"][(0, 0)]["records"]["noise_seed"].ge(0).any()
        ahead.load_state_dict(saved)
        assert ahead.queued((0, 0))  # this version's: kept
        del saved["ready"][(0, 0)]["noise_generator"]  # as an earlier version saved it
        with caplog.at_level("WARNING", logger="ngrpo_lightning.rollout.ahead"):
            ahead.load_state_dict(saved)
        assert not ahead.queued((0, 0)) and "made again" in caplog.text
        batch = ahead.rollouts_for((0, 0), [], lambda key: job, lambda: trainable_snapshot(model), 0)
        assert batch.records.has_noise()
    finally:
        ahead.close()


def test_a_job_at_the_version_queued_last_carries_no_weights(tiny):
    """A snapshot (under FSDP2 a gather of the whole model) is taken once per policy version: the
    step's extra batches (dynamic sampling), queued after the step's own job at the same version,
    carry none, and decode the weights that job loaded; a new version takes one again."""
    from conftest import chat_prompt_ids

    from ngrpo_lightning.explorers import TemperatureExplorer
    from ngrpo_lightning.rollout import HFEngine
    from ngrpo_lightning.rollout.ahead import RolloutsAhead
    from ngrpo_lightning.rollout.worker_copy import trainable_snapshot

    model, tok = tiny
    prompts = chat_prompt_ids(tok, ["What is 2 + 3?"])
    ahead = RolloutsAhead(model, lambda m: HFEngine(m, tok, max_new_tokens=4, seed=0), threads=1)
    taken = []

    def weights():
        taken.append(len(taken))
        return trainable_snapshot(model)

    job = lambda engine: engine.generate(prompts, TemperatureExplorer(temperature=0.0), n=1)  # noqa: E731
    try:
        first = ahead.rollouts_for((0, 0), [(0, 1)], lambda key: job, weights, 0)  # one snapshot for both jobs
        assert len(taken) == 1
        extra = ahead.run_now(job, weights, 0)  # the version queued last: no snapshot
        assert len(taken) == 1 and torch.equal(extra.response_ids, first.response_ids)
        ahead.run_now(job, weights, 1)
        assert len(taken) == 2 and ahead.version == 1
    finally:
        ahead.close()
