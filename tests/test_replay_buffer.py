"""ReplayBuffer: several updates per step, replay of past successes, checkpointed state."""

import copy

import pytest
import torch
from conftest import ScriptedReward, fake_step, tiny_rl, tiny_trainer

from ngrpo_lightning.callbacks import ReplayBuffer
from ngrpo_lightning.training.planning import UpdatePlan
from ngrpo_lightning.training.settings import TrainConfig


def test_all_wrong_group_gets_a_stored_success_with_its_records():
    buf = ReplayBuffer(capacity=4, max_staleness=2)
    first = fake_step(["a", "a", "b", "b"], [0, 1, 0, 0], lengths=[2, 3, 3, 1])
    buf.on_train_batch_end(None, None, {"rollouts": first}, None, 0)
    assert list(buf.entries) == ["a"] and buf.entries["a"]["response_ids"].tolist() == [200, 201, 202]

    later = fake_step(["a", "a", "b", "b"], [0, 0, 0, 0], lengths=[1, 1, 2, 2])
    mixed = buf.mix_in(later)
    assert mixed.stats["replay/substituted"] == 1
    assert mixed.replayed.tolist() == [False, True, False, False]
    assert mixed.rewards.tolist() == [0, 1, 0, 0]
    b = mixed.batch
    assert b.response_ids[1, :3].tolist() == [200, 201, 202] and b.response_mask[1].tolist() == [1, 1, 1]
    assert b.response_mask[0].tolist() == [1, 0, 0]  # fresh rows re-padded to the new width
    assert b.problem_ids == ["a", "a", "b", "b"] and b.response_text[1] == "r1"
    assert torch.allclose(mixed.behaviour_logp[1], torch.tensor([-0.2, -0.2, -0.2]))
    assert mixed.behaviour_logp[0].abs().sum() == 0
    # the stored mixed step is row 1's again, the other rows keep theirs
    assert sorted(b.records.row.tolist()) == [0, 1, 2, 3]
    assert b.records.ids[b.records.row == 1].tolist() == [[2, 3]]
    assert b.prompt_ids[1][b.prompt_mask[1].bool()].tolist() == [0, 11, 21]


def test_stale_and_over_capacity_entries_are_forgotten():
    buf = ReplayBuffer(capacity=1, max_staleness=1)
    buf.on_train_batch_end(None, None, {"rollouts": fake_step(["a", "a"], [1, 0])}, None, 0)
    buf.on_train_batch_end(None, None, {"rollouts": fake_step(["b", "b"], [1, 1])}, None, 1)
    assert list(buf.entries) == ["b"]  # capacity 1: "a" (older) evicted
    assert buf.mix_in(fake_step(["b", "b"], [0, 0])).stats["replay/substituted"] == 1  # sampled at step 1, now step 2
    buf.on_train_batch_end(None, None, {"rollouts": fake_step(["c", "c"], [0, 0])}, None, 2)
    assert buf.entries == {}  # it would be 2 steps old at step 3 > max_staleness


def test_groups_with_a_success_are_left_alone():
    buf = ReplayBuffer(capacity=4)
    buf.on_train_batch_end(None, None, {"rollouts": fake_step(["a", "a"], [1, 0])}, None, 0)
    step = fake_step(["a", "a"], [0, 1])
    assert buf.mix_in(step) is step and step.stats["replay/substituted"] == 0


def test_plan_updates_covers_every_row_once_per_epoch_and_weights_replayed_rows():
    buf, plan = ReplayBuffer(capacity=4, is_cap=1.5), UpdatePlan(ppo_epochs=2, num_mini_batches=2)
    step = fake_step(["a", "a", "b", "b", "c", "c"], [1, 0, 1, 0, 1, 0])
    step.advantages = torch.ones(6)
    step.replayed[3] = True
    step.behaviour_logp[3] = step.old_logp[3] - 1.0  # the policy now likes it e^1 more: weight capped at 1.5
    updates = plan.updates(buf.weigh(step))
    assert len(updates) == 4
    for epoch in (updates[:2], updates[2:]):
        rows = sorted(r for u in epoch for r in u.batch.response_text)
        assert rows == [f"r{i}" for i in range(6)]
    weights = {t: a.item() for u in updates for t, a in zip(u.batch.response_text, u.advantages)}
    assert weights["r3"] == pytest.approx(1.5) and weights["r0"] == 1.0
    assert step.stats["replay/is_weight_mean"] == pytest.approx(1.5)


@pytest.mark.parametrize(
    "make, key",
    [
        (lambda: TrainConfig(ppo_epochs=0), "train.ppo_epochs"),
        (lambda: TrainConfig(num_mini_batches=0), "train.num_mini_batches"),
        (lambda: ReplayBuffer(capacity=-1), "replay.capacity"),
        (lambda: ReplayBuffer(capacity=1, max_staleness=0), "replay.max_staleness"),
        (lambda: ReplayBuffer(capacity=1, is_cap=0.5), "replay.is_cap"),
    ],
)
def test_bad_replay_config_names_the_key(make, key):
    with pytest.raises(ValueError, match=key):
        make()


def test_second_ppo_epoch_sees_moved_ratios_and_clips(tiny):
    module, dm = tiny_rl(tiny, ScriptedReward([1, 0]), lr=3e-2, ppo_epochs=2)
    trainer = tiny_trainer(max_steps=2)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2  # optimizer steps: one rollout batch, two updates
    first, second = module.update_metrics
    assert first["ratio_min"] == pytest.approx(1.0, abs=1e-5) and first["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert first["clip_frac_low"] == first["clip_frac_high"] == 0.0
    assert abs(second["ratio_max"] - 1) > 1e-3 or abs(second["ratio_min"] - 1) > 1e-3
    assert second["clip_frac_low"] + second["clip_frac_high"] > 0
    assert trainer.callback_metrics["train/updates"] == 2


class Snapshots:
    """Copies the buffer's state after every training step and at train start. A step's end is
    seen at the next step's start (or the end of training): the module attaches the buffer after
    the Trainer's own callbacks, so at a step's end this one would run before the buffer's."""

    def __init__(self, buffer):
        self.buffer, self.after_step, self.at_start = buffer, [], None

    def on_train_start(self, trainer, pl_module):
        self.at_start = copy.deepcopy(self.buffer.state_dict())
        self.plan_at_start = copy.deepcopy(pl_module.plan.state_dict())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.buffer.steps_seen > self.at_start["steps_seen"] + len(self.after_step):
            self.after_step.append(copy.deepcopy(self.buffer.state_dict()))

    def on_train_end(self, trainer, pl_module):
        self.on_train_batch_start(trainer, pl_module, None, 0)


def snapshot_callback(buffer):
    import lightning as L

    return type("SnapshotCallback", (Snapshots, L.Callback), {})(buffer)


def assert_same_state(a, b):
    assert a["steps_seen"] == b["steps_seen"]
    assert len(a["entries"]) == len(b["entries"])
    for x, y in zip(a["entries"], b["entries"]):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], dict):
                assert all(torch.equal(x[k][j], y[k][j]) for j in x[k])
            elif isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k])
            else:
                assert x[k] == y[k]


def test_checkpoint_mid_run_restores_the_buffer_exactly(tiny, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    # step 0: every group has a success (stored); step 1: all wrong -> the stored ones are replayed
    reward = ScriptedReward([1, 0], [0, 0])
    buffer = ReplayBuffer(capacity=4, max_staleness=3)
    module, dm = tiny_rl(tiny, reward, num_mini_batches=2, step_hooks=[buffer])
    spy = snapshot_callback(buffer)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = tiny_trainer(max_steps=4, callbacks=[spy, ckpt], enable_checkpointing=True)
    trainer.fit(module, datamodule=dm)  # 2 rollout batches of 2 updates each
    assert trainer.callback_metrics["replay/substituted"] == 2
    assert len(spy.after_step) == 2 and len(buffer.entries) == 2

    saved = torch.load(tmp_path / "step=2.ckpt", weights_only=True)  # plain tensors and values only
    restored = ReplayBuffer(capacity=4, max_staleness=3)
    restored.load_state_dict(saved["callbacks"][buffer.state_key])
    assert_same_state(restored.state_dict(), spy.after_step[0])
    assert len(restored.entries) == 2
    # the mini-batch shuffling moved on and is saved with the module
    assert not torch.equal(saved["update_plan"]["generator"], torch.Generator().manual_seed(0).get_state())

    # resuming through Lightning restores it too, before training goes on
    buffer2 = ReplayBuffer(capacity=4, max_staleness=3)
    module2, dm2 = tiny_rl(tiny, ScriptedReward([0, 0]), num_mini_batches=2, step_hooks=[buffer2])
    spy2 = snapshot_callback(buffer2)
    trainer2 = tiny_trainer(max_steps=4, callbacks=[spy2])
    trainer2.fit(module2, datamodule=dm2, ckpt_path=tmp_path / "step=2.ckpt")
    assert_same_state(spy2.at_start, spy.after_step[0])
    assert torch.equal(spy2.plan_at_start["generator"], saved["update_plan"]["generator"])
    assert buffer2.steps_seen == 2 and trainer2.callback_metrics["replay/substituted"] == 2


def test_replay_with_one_update_per_step_weighs_replayed_rows_by_a_real_forward(tiny):
    """One update per step takes its old log-probs from its own forward, except when rows are
    replayed: their importance weights need the old log-probs before the update."""
    buffer = ReplayBuffer(capacity=4, max_staleness=3)
    module, dm = tiny_rl(tiny, ScriptedReward([1, 0], [0, 0]), step_hooks=[buffer])
    trainer = tiny_trainer(max_steps=2)
    trainer.fit(module, datamodule=dm)
    assert trainer.callback_metrics["replay/substituted"] == 2
    weight = float(trainer.callback_metrics["replay/is_weight_mean"])
    assert 0.0 < weight <= buffer.is_cap and weight != 1.0  # the policy moved since the success was sampled


def test_a_step_hook_given_only_to_the_trainer_is_refused(tiny):
    module, dm = tiny_rl(tiny, ScriptedReward([1, 0]))
    trainer = tiny_trainer(max_steps=1, callbacks=[ReplayBuffer(capacity=4)])
    with pytest.raises(ValueError, match=r"ReplayBuffer takes part in training steps: give it to the module"):
        trainer.fit(module, datamodule=dm)


def test_saved_noise_of_another_generator_is_dropped_not_rebuilt_wrong():
    """Records whose noise an earlier version made (another generator) cannot be rebuilt as their
    rollout saw them: a restored buffer drops those entries, rollouts in flight are refused (and
    made again), and records without noise are kept."""
    from ngrpo_lightning.rollout.batch import RolloutBatch

    buf = ReplayBuffer(capacity=4, max_staleness=2)
    step = fake_step(["a", "a", "b", "b"], [1, 0, 1, 0], lengths=[2, 3, 3, 1])
    step.batch.records.noise_seed[step.batch.records.row == 2] = 7  # b's success was noisy
    buf.on_train_batch_end(None, None, {"rollouts": step}, None, 0)
    saved = buf.state_dict()
    restored = ReplayBuffer(capacity=4, max_staleness=2)
    restored.load_state_dict(saved)
    assert list(restored.entries) == ["a", "b"]  # this version's: both kept
    old = {k: v for k, v in saved.items() if k != "noise_generator"}  # as an earlier version saved it
    restored.load_state_dict(old)
    assert list(restored.entries) == ["a"]

    state = step.batch.state_dict()
    assert RolloutBatch.from_state_dict(state).records.has_noise()
    state.pop("noise_generator")
    with pytest.raises(ValueError, match="noise generator None"):
        RolloutBatch.from_state_dict(state)
    clean = step.batch.select([0, 1]).state_dict()
    clean.pop("noise_generator")
    assert not RolloutBatch.from_state_dict(clean).records.has_noise()  # nothing to rebuild: kept
