"""benchmarks/harness.py vs_trl: both sides are configured with the same workload (workloads.py).

Built from the functions the benchmark configures each side with (our composed config, TRL's
``GRPOConfig`` and trainer), on the tiny model (the real SmolLM2 tokenizer and chat template);
nothing is trained or generated. TRL is in the dev extra (``make test`` installs it; the
benchmark's own extra is ``bench``); without it these tests are skipped. TRL's side is imported by
the tests that use it, not when the suite is collected: its trainer imports vLLM where vLLM is
installed, seconds in every test process.
"""

import dataclasses
import itertools
import sys
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")  # its names load when first used
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import harness  # noqa: E402
import side_ours  # noqa: E402
import sides as sides_of  # noqa: E402
import vs_trl  # noqa: E402
import workloads  # noqa: E402

# TRL's trainer warns, on import, that the vLLM installed for this project's tests is newer than it
# supports; these tests never generate with vLLM
pytestmark = pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions:UserWarning")

WORKLOAD = workloads.side_by_side(model="tiny", steps=2)


@pytest.fixture(scope="module")
def trl_side():
    """The benchmark's TRL side (``benchmarks/side_trl.py``)."""
    import side_trl

    return side_trl


@pytest.fixture(scope="module")
def sides(tmp_path_factory, trl_side):
    """(our composed config, TRL's trainer) of the workload."""
    out = tmp_path_factory.mktemp("vs-trl")
    cfg = side_ours.ours_config(WORKLOAD, str(out / "ours"))
    with trl_side.math_reward_of(WORKLOAD) as reward:
        yield cfg, trl_side.build_trainer(WORKLOAD, str(out / "trl"), reward)


def workload_of(*argv):
    return harness.workload_from(harness.parser().parse_args(list(argv)))


def test_the_defaults_are_the_benchmark_workload():
    w = workload_of("vs_trl")
    assert w == workloads.Workload() == workloads.side_by_side()
    assert (w.model, w.dtype, w.prompts, w.group, w.tokens) == ("smollm2-135m-instruct", "float32", 4, 8, 40)
    assert (w.temperature, w.kl_coef, w.threads, w.natural, w.engine) == (1.0, 0.001, 2, False, "hf")


def test_same_prompts_in_the_same_order(sides):
    """Step k: TRL's batch, as its sampler draws and its tokenizer encodes it, is our k-th prompt
    batch (chat template applied), each prompt repeated group-size times in a row."""
    _, trainer = sides
    ours = side_ours.prompt_batches(WORKLOAD)
    theirs = list(itertools.islice(trainer.get_train_dataloader(), WORKLOAD.steps))
    assert len(ours) == len(theirs) == WORKLOAD.steps
    for our_batch, rows in zip(ours, theirs):
        assert len(our_batch["prompt_ids"]) == WORKLOAD.prompts
        repeat = lambda values: [v for v in values for _ in range(WORKLOAD.group)]
        prompt_ids, _, _ = trainer._tokenize_prompts([row["prompt"] for row in rows])
        assert [list(ids) for ids in prompt_ids] == repeat(our_batch["prompt_ids"])
        assert [row["answer"] for row in rows] == repeat(our_batch["answer"])
        assert all(text.rstrip().endswith("<|im_start|>assistant") for text in our_batch["prompt_text"])


def test_same_model_and_dtype(sides):
    cfg, trainer = sides
    assert trainer.model.config._name_or_path == cfg.model.name_or_path == WORKLOAD.model_path()
    assert cfg.model.dtype == WORKLOAD.dtype and trainer.model.dtype == getattr(torch, WORKLOAD.dtype)
    assert not trainer.args.bf16 and not trainer.args.fp16  # no autocast: the weights' dtype, as ours
    assert not trainer.args.gradient_checkpointing and not cfg.model.gradient_checkpointing


def test_same_group_and_one_update_per_rollout_batch(sides):
    cfg, trainer = sides
    args = trainer.args
    assert trainer.num_generations == cfg.rollout.group_size == WORKLOAD.group
    batch = cfg.data.prompts_per_step * cfg.rollout.group_size
    assert cfg.data.prompts_per_step == WORKLOAD.prompts
    assert args.generation_batch_size == args.per_device_train_batch_size == batch
    assert args.gradient_accumulation_steps == args.steps_per_generation == args.num_iterations == 1
    assert cfg.train.ppo_epochs == cfg.train.num_mini_batches == 1
    assert args.max_steps == cfg.trainer.max_steps == WORKLOAD.steps


def test_same_generation(sides):
    cfg, trainer = sides
    gen = trainer.generation_config
    assert gen.max_new_tokens == gen.min_new_tokens == cfg.rollout.max_new_tokens == WORKLOAD.tokens
    assert cfg.rollout.ignore_eos  # ours: no EOS ends a response, each is max_new_tokens long
    assert gen.do_sample and gen.temperature == cfg.explorer.temperature == WORKLOAD.temperature
    assert cfg.explorer.name == "temperature" and (cfg.explorer.top_k, cfg.explorer.top_p) == (gen.top_k, gen.top_p)
    assert (gen.top_k, gen.top_p) == (0, 1.0)
    assert not trainer.use_vllm and cfg.rollout.engine == "hf"


def test_micro_batches_split_the_same_update_on_both_sides(tmp_path, trl_side):
    """--micro-batch: the same rows per forward/backward on both sides, still one generation of
    the whole batch and one optimizer update per step."""
    split = dataclasses.replace(WORKLOAD, micro_batch=8)
    cfg, args = side_ours.ours_config(split, str(tmp_path)), trl_side.trl_config(split, str(tmp_path))
    batch = split.prompts * split.group
    assert cfg.optim.micro_batch_size == args.per_device_train_batch_size == 8
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == batch
    assert args.generation_batch_size == batch and args.steps_per_generation == args.gradient_accumulation_steps
    with pytest.raises(ValueError, match="micro_batch=5 must divide"):
        trl_side.trl_config(dataclasses.replace(WORKLOAD, micro_batch=5))


def test_the_options_change_the_workload_and_the_default_job_takes_only_its_own():
    w = workload_of("vs_trl", "--tokens", "256", "--micro-batch", "8", "--no-saves", "--extra", "a=1", "b=2")
    assert (w.tokens, w.micro_batch, w.saves, w.extra) == (256, 8, False, ("a=1", "b=2"))
    assert workload_of("speedup", "x", "--steps", "3") == workloads.default_job(steps=3)
    with pytest.raises(SystemExit):
        workload_of("speedup", "x", "--tokens", "256")  # the default job has no such setting


def test_a_speedups_arms_differ_in_it_alone():
    on, off = workloads.arms(WORKLOAD, "shared_prompts")
    assert on.extra == ("backend.enable=[shared_prompts]",) and off.extra == ("backend.disable=[shared_prompts]",)
    assert dataclasses.replace(on, extra=()) == dataclasses.replace(off, extra=()) == WORKLOAD
    ours_on, ours_off = side_ours.ours_config(on), side_ours.ours_config(off)
    assert list(ours_on.backend.enable) == list(ours_off.backend.disable) == ["shared_prompts"]
    on, off = workloads.arms(workloads.default_job(), "nondeterministic")
    assert side_ours.ours_config(off).trainer.deterministic and not side_ours.ours_config(on).trainer.deterministic


def test_natural_lengths_keep_eos_on_both_sides(trl_side):
    natural = dataclasses.replace(WORKLOAD, natural=True)
    assert trl_side.trl_config(natural).generation_kwargs is None
    assert not side_ours.ours_config(natural).rollout.ignore_eos


def test_same_objective_and_optimizer(sides):
    cfg, trainer = sides
    args, objective, optim = trainer.args, cfg.objective, cfg.optim
    assert trainer.beta == objective.kl_coef == WORKLOAD.kl_coef and trainer.ref_model is not None
    assert objective.name == "grpo" and objective.kl_estimator == "k3"  # TRL's KL is k3
    assert (args.epsilon, args.epsilon_high) == (objective.clip_low, objective.clip_high)
    assert args.loss_type == "dapo" and objective.loss_agg == "token-mean"
    assert args.scale_rewards == "group" and cfg.advantage == "grpo"
    assert args.learning_rate == optim.lr == WORKLOAD.lr
    assert args.lr_scheduler_type == "constant" and args.warmup_steps == optim.warmup_steps == 0
    assert (args.adam_beta1, args.adam_beta2) == tuple(optim.betas) and args.weight_decay == optim.weight_decay
    assert args.max_grad_norm == optim.grad_clip
    assert args.optim == "adamw_torch_fused"  # ours: fused AdamW on plain (unsharded) parameters


def test_same_reward(sides):
    _, trainer = sides
    (reward,) = trainer.reward_funcs
    assert reward(completions=["So \\boxed{12}.", "The answer is 7."], answer=["12", "12"]) == [1.0, 0.0]


def test_each_side_saves_as_its_defaults_do_unless_told_not_to(trl_side):
    ours, trl = side_ours.ours_config(WORKLOAD), trl_side.trl_config(WORKLOAD)
    assert ours.trainer.get("enable_checkpointing", True) and ours.checkpoint.every_n_steps > 0
    assert str(trl.save_strategy).lower().endswith("steps") and trl.save_steps == 500  # TRL's own default
    quiet = dataclasses.replace(WORKLOAD, saves=False)
    assert side_ours.ours_config(quiet).trainer.enable_checkpointing is False
    assert str(trl_side.trl_config(quiet).save_strategy).lower().endswith("no")


def test_the_trl_ac_side_is_trl_with_its_default_activation_checkpointing(tmp_path, trl_side):
    script, changes = sides_of.SIDES["trl-ac"]
    assert script == sides_of.SIDES["trl"][0]
    config = trl_side.trl_config(dataclasses.replace(WORKLOAD, **changes))
    default = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True).gradient_checkpointing
    assert config.gradient_checkpointing is default is True
    assert vs_trl.run_order(2, ["ours", "trl", "trl-ac"]) == ["ours", "trl", "trl-ac", "trl-ac", "trl", "ours"]
