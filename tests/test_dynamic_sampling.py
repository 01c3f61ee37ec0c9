"""Dynamic sampling (DAPO): groups with equal rewards are dropped and the batch refilled."""

import pytest
import torch
from conftest import ScriptedReward, fake_step, tiny_rl, tiny_trainer

from ngrpo_lightning.rollout import RolloutBatch, RolloutEngine
from ngrpo_lightning.training.updates import StepRollouts


def run_one_step(tiny, reward, **kwargs):
    module, dm = tiny_rl(tiny, reward, num_problems=6, dynamic_sampling=True, **kwargs)
    seen = {}
    original = module.optimize

    def spy(updates):
        seen["updates"] = updates
        return original(updates)

    module.optimize = spy
    trainer = tiny_trainer(max_steps=1)
    trainer.fit(module, datamodule=dm)
    return trainer.callback_metrics, seen["updates"], dm


def test_zero_variance_groups_are_replaced_by_extra_rollouts(tiny):
    # batch: group 0 all wrong, group 1 mixed; extra batch: both groups mixed (one is surplus)
    metrics, updates, dm = run_one_step(tiny, ScriptedReward([0, 0, 1, 0], [1, 0, 1, 0]))
    assert metrics["dynamic/dropped_groups"] == 1 and metrics["dynamic/extra_rollouts"] == 1
    assert metrics["dynamic/kept_groups"] == 2
    (step,) = updates
    assert len(step) == 4 and step.rewards.tolist() == [1, 0, 1, 0]
    assert metrics["train/reward"] == pytest.approx(0.25)  # the original batch's
    assert metrics["train/zero_variance_groups"] == pytest.approx(0.5)
    assert dm.extra_prompts_drawn == 2


def test_extra_rollouts_are_bounded(tiny):
    metrics, updates, dm = run_one_step(tiny, ScriptedReward([0, 0]), max_extra_rollouts=1)
    assert metrics["dynamic/extra_rollouts"] == 1 and metrics["dynamic/dropped_groups"] == 4
    assert metrics["dynamic/kept_groups"] == 0
    assert len(updates[0]) == 4  # nothing informative: the original batch (zero advantages)
    assert dm.extra_prompts_drawn == 2


def test_all_correct_groups_only_are_dropped_for_ngrpo(tiny):
    # batch: group 0 all correct (dropped), group 1 all wrong (kept: calibrated advantages learn from it)
    metrics, updates, dm = run_one_step(
        tiny, ScriptedReward([1, 1, 0, 0], [1, 0, 1, 0]), drop_groups="all_correct", advantage="calibrated"
    )
    assert metrics["dynamic/dropped_groups"] == 1 and metrics["dynamic/kept_groups"] == 2
    (step,) = updates
    assert step.rewards.tolist() == [0, 0, 1, 0]  # the all-wrong group, then a group of the extra batch
    assert (step.advantages[:2] < 0).all()


def test_bad_max_extra_rollouts_names_the_key(tiny):
    with pytest.raises(ValueError, match="train.max_extra_rollouts"):
        tiny_rl(tiny, ScriptedReward([0]), max_extra_rollouts=-1)


class Recorder(RolloutEngine):
    """An engine that rolls out nothing: it keeps the prompts it was given and the policy versions
    it was told."""

    def __init__(self):
        self.prompts, self.told = None, []

    def generate(self, prompts, explorer, n, max_new_tokens):
        self.prompts = prompts
        self.told.append(self.policy_version)
        return RolloutBatch.__new__(RolloutBatch)


def fake_trainer():
    """A trainer whose module gives the run context the DataModule reads (nothing else)."""
    from ngrpo_lightning.backends import CPUBackend
    from ngrpo_lightning.explorers import TemperatureExplorer
    from ngrpo_lightning.rollout.context import PolicyVersion, RunContext

    context = RunContext(
        torch.nn.Linear(1, 1), None, TemperatureExplorer(), TemperatureExplorer(0.0), None, CPUBackend(),
        PolicyVersion(), None, lambda model: None,
    )  # fmt: skip
    return type("T", (), {"lightning_module": type("M", (), {"context": context})()})()


def test_more_rollouts_stream_is_seeded_and_covers_the_training_set(tokenizer):
    from ngrpo_lightning.data import reasoning_gym_problems
    from ngrpo_lightning.rollout import RolloutDataModule

    problems = reasoning_gym_problems(["chain_sum"], 5, seed=0)
    drawn = []
    for _ in range(2):
        dm = RolloutDataModule(tokenizer, problems, prompts_per_step=2, group_size=1, seed=3)
        dm.engines.engine, dm.trainer = Recorder(), fake_trainer()
        ids = []
        for _ in range(5):  # 10 prompts: two passes over the 5
            dm.more_rollouts()
            ids += [tuple(p) for p in dm.engine.prompts]
        drawn.append(ids)
        assert len(set(ids[:5])) == 5 and len(set(ids[5:])) == 5 and dm.state_dict()["extra_prompts_drawn"] == 10
    assert drawn[0] == drawn[1]


def test_step_rollouts_concat_and_select_groups_keep_rows_aligned():
    a = fake_step(["a", "a", "b", "b"], [0, 1, 1, 1], lengths=[1, 2, 1, 1])
    b = fake_step(["c", "c"], [1, 0], lengths=[3, 1])
    joined = StepRollouts.concat([a, b])
    assert joined.batch.response_ids.shape == (6, 3) and joined.old_logp.shape == (6, 3)
    picked = joined.select_groups([0, 2])
    assert picked.batch.problem_ids == ["a", "a", "c", "c"] and picked.rewards.tolist() == [0, 1, 1, 0]
    assert picked.batch.records.row.tolist() == [0, 1, 2, 3]
    assert picked.batch.response_ids[2].tolist() == [100, 101, 102]  # row 0 of b


def test_the_datamodule_reads_the_run_through_its_context():
    from ngrpo_lightning.rollout.context import run_context

    assert run_context(fake_trainer()).version.value == 0
    with pytest.raises(TypeError, match="object gives no RunContext .*RLModule provides one"):
        run_context(type("T", (), {"lightning_module": object()})())


def test_every_rollout_is_told_the_policy_version_it_decodes(tokenizer):
    """An engine keeping weights of its own without a sync (HFEngine's copy of an FSDP2 policy)
    rewrites them only when the version moved: the run tells it the version before each rollout."""
    from ngrpo_lightning.data import reasoning_gym_problems
    from ngrpo_lightning.rollout import RolloutDataModule

    dm = RolloutDataModule(tokenizer, reasoning_gym_problems(["chain_sum"], 4, seed=0), prompts_per_step=2, seed=0)
    dm.engines.engine, dm.trainer = Recorder(), fake_trainer()
    version = dm.trainer.lightning_module.context.version
    for _ in range(3):
        dm.more_rollouts()
        version.advance()
    assert dm.engine.told == [0, 1, 2]


def test_every_rank_rolls_out_while_any_rank_is_short():
    """Several processes: a rollout may be a collective, so a rank already full rolls out as many
    extra batches as the rank that needs the most, and keeps its first groups."""
    from ngrpo_lightning.training.planning import DynamicSampling

    full = fake_step(list("aabb"), [1, 0, 0, 1])  # both groups informative
    extras = []

    def more():
        extras.append(fake_step(list("ccdd"), [1, 0, 1, 0]))
        return extras[-1]

    sampling = DynamicSampling(max_extra_rollouts=3)
    assert sampling.fill(full, more).stats["dynamic/extra_rollouts"] == 0  # one process: nothing more
    another_short = iter([1, 1, 0])  # the other rank is short for two more batches
    filled = sampling.fill(full, more, agree=lambda short: max(short, next(another_short)))
    assert filled.stats["dynamic/extra_rollouts"] == 2 and len(extras) == 2
    assert filled.batch.problem_ids == list("aabb")  # its own first groups
    always_short = sampling.fill(full, more, agree=lambda short: 1)
    assert always_short.stats["dynamic/extra_rollouts"] == 3  # bounded all the same


def test_each_rank_rolls_out_its_own_share_of_the_extra_prompts(tokenizer):
    from ngrpo_lightning.data import reasoning_gym_problems
    from ngrpo_lightning.rollout import RolloutDataModule

    problems = reasoning_gym_problems(["chain_sum"], 8, seed=0)
    drawn = {}
    for rank in (0, 1):
        dm = RolloutDataModule(tokenizer, problems, prompts_per_step=2, group_size=1, seed=3)
        trainer = fake_trainer()
        trainer.global_rank, trainer.world_size = rank, 2
        dm.engines.engine, dm.trainer = Recorder(), trainer
        drawn[rank] = []
        for _ in range(2):  # 8 prompts: one pass over the set by both ranks together
            dm.more_rollouts()
            drawn[rank] += [tuple(p) for p in dm.engine.prompts]
        assert dm.extra_prompts_drawn == 8  # the same position on every rank
    assert len(drawn[0]) == len(drawn[1]) == 4 and len(set(drawn[0]) | set(drawn[1])) == 8
