"""Experiment configs compose into the intended objective and training settings; bad
objective and training keys fail with errors that name them."""

import pytest

from ngrpo_lightning.build.components import build_objective, build_step_hooks, settings
from ngrpo_lightning.commands.cli import main
from ngrpo_lightning.config import ConfigError, compose, config_dir
from ngrpo_lightning.objectives import GRPO, GSPO


def test_gspo_experiment():
    cfg = compose(["experiment=gspo"])
    obj = build_objective(cfg.objective)
    assert isinstance(obj, GSPO) and (obj.clip_low, obj.clip_high, obj.kl_coef) == (3e-4, 4e-4, 0.0)
    assert cfg.explorer.name == "temperature" and cfg.experiment_name == "gspo"


def test_dapo_experiment():
    cfg = compose(["experiment=dapo"])
    obj = build_objective(cfg.objective)
    assert isinstance(obj, GRPO) and (obj.clip_low, obj.clip_high) == (0.2, 0.28)
    assert obj.loss_agg == "token-mean" and not obj.needs_reference and cfg.train.dynamic_sampling


def test_dr_grpo_experiment():
    cfg = compose(["experiment=dr-grpo", "rollout.max_new_tokens=96"])
    obj = build_objective(cfg.objective)
    assert obj.loss_agg == "seq-mean-token-sum-norm" and obj.norm_length == 96 and cfg.advantage == "dr_grpo"
    assert not obj.needs_reference


def test_ne_grpo_experiment_is_nan_et_al_ngrpo():
    cfg = compose(["experiment=ne-grpo"])
    obj = build_objective(cfg.objective)
    assert isinstance(obj, GRPO) and (obj.clip_low, obj.clip_high, obj.kl_coef) == (0.16, 0.24, 0.0)
    assert cfg.advantage == "calibrated" and cfg.train.dynamic_sampling and cfg.train.drop_groups == "all_correct"
    assert compose(["experiment=ne-grpo", "explorer=neighbor"]).explorer.name == "neighbor"


@pytest.mark.parametrize(
    "name, size, lr, kl, mix",
    [
        ("n-grpo-1.5b", "1.5B", 5e-7, 0.01, (2, 0.1)),
        ("n-grpo-7b", "7B", 1e-6, 0.001, (3, 0.15)),
        ("grpo-1.5b", "1.5B", 1e-6, 0.001, None),
        ("grpo-7b", "7B", 1e-6, 0.001, None),
    ],
)
def test_release_presets_compose_with_the_release_settings(name, size, lr, kl, mix, capsys):
    from ngrpo_lightning.build.components import build_explorer

    cfg = compose([f"experiment={name}", "data.train=train.parquet"])
    assert cfg.model.name_or_path == f"deepseek-ai/DeepSeek-R1-Distill-Qwen-{size}"
    assert (cfg.rollout.group_size, cfg.rollout.max_new_tokens, cfg.data.max_prompt_tokens) == (4, 8192, 4096)
    assert cfg.data.problem_field == "prompt" and cfg.data.answer_field == "reward_model.ground_truth"
    optim, train, _ = settings(cfg)
    assert optim.lr == lr and train.num_mini_batches == 4
    obj = build_objective(cfg.objective)
    assert (obj.kl_coef, obj.kl_estimator, obj.kl_clamp, obj.dual_clip) == (kl, "k3", 10.0, 3.0)
    explorer = build_explorer(cfg.explorer)
    if mix:
        assert (explorer.k, explorer.rho, explorer.emit, explorer.metric) == (*mix, "sampled", "cosine")
    else:
        assert explorer.registered_name == "temperature"
    assert main(["config", f"experiment={name}"]) == 0  # printable without the data path
    assert "data.train has no value yet" in capsys.readouterr().err


def test_the_7b_lora_preset_is_the_release_preset_on_one_gpu_with_adapters():
    from ngrpo_lightning.build.models import lora_settings, parallel_config

    release = compose(["experiment=n-grpo-7b", "data.train=train.parquet"])
    cfg = compose(["experiment=n-grpo-7b-lora", "data.train=train.parquet"])
    assert lora_settings(cfg) == lora_settings(compose(["model.lora.enabled=true"]))  # rank 16, alpha 32, all-linear
    assert parallel_config(cfg) is None and cfg.trainer.accelerator == "gpu" and cfg.trainer.devices == 1
    assert cfg.model.gradient_checkpointing and cfg.rollout.engine == "vllm" and cfg.optim.lr == 1e-5
    # the release's global batch (8 GPUs x 8 prompts) on the one GPU; the rest as the release
    assert cfg.data.prompts_per_step == 8 * release.data.prompts_per_step
    for key in ("explorer", "objective", "train", "pass_at_k"):
        assert cfg[key] == release[key], key
    assert (cfg.rollout.group_size, cfg.rollout.max_new_tokens) == (release.rollout.group_size, 8192)


@pytest.mark.skipif(
    not (config_dir() / "explorer" / "neighbor.yaml").is_file(), reason="the neighbor explorer config is not there yet"
)
def test_n_gspo_experiment():
    cfg = compose(["experiment=n-gspo"])
    assert isinstance(build_objective(cfg.objective), GSPO) and cfg.explorer.name == "neighbor"


def test_replay_buffer_is_attached_only_when_asked_for():
    assert build_step_hooks(compose([])) == []
    cfg = compose(["train.ppo_epochs=2", "train.num_mini_batches=3"])
    assert build_step_hooks(cfg) == []  # several updates per step are the module's UpdatePlan, not a callback
    _, train, replay = settings(cfg)
    assert (train.ppo_epochs, train.num_mini_batches, replay.capacity) == (2, 3, 0)
    (buffer,) = build_step_hooks(compose(["replay.capacity=8", "replay.is_cap=3"]))
    assert (buffer.capacity, buffer.is_cap) == (8, 3.0)


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.ppo_epochs=0", "train.ppo_epochs"),
        ("replay.max_staleness=0", "replay.max_staleness"),
    ],
)
def test_bad_training_keys_are_named(override, key):
    with pytest.raises(ConfigError, match=key):
        build_step_hooks(compose([override]))


@pytest.mark.parametrize(
    "args, key",
    [
        (["objective.name=ppo2"], "objective.name"),
        (["objective=gspo", "objective.clip_low=-0.1"], "objective.clip_low"),
        (["objective.loss_agg=sum"], "objective.loss_agg"),
        (["objective.kl_estimator=k4"], "objective.kl_estimator"),
    ],
)
def test_bad_objective_keys_are_named_by_the_cli(capsys, args, key):
    assert main(["train", "model=tiny", "logger=none", *args]) == 2
    err = capsys.readouterr().err
    assert key in err and ("allowed" in err or "must be" in err)


def test_kl_without_a_reference_model_is_refused(tiny):
    from conftest import ScriptedReward, tiny_rl

    with pytest.raises(ValueError, match="objective.kl_coef"):
        tiny_rl(tiny, ScriptedReward([0]), objective=GRPO(kl_coef=0.01))
