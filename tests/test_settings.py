"""Settings: each default in one place (ngrpo_lightning/schema.py, placed by conf/config.yaml), and
every bad value refused with its full key, once, before any model loads."""

import dataclasses

import pytest

from ngrpo_lightning.build import components
from ngrpo_lightning.checks import check_choice, check_number
from ngrpo_lightning.commands.cli import main
from ngrpo_lightning.config import compose
from ngrpo_lightning.objectives import ADVANTAGE_ESTIMATORS, group_advantages, register_advantage
from ngrpo_lightning.training.settings import OptimConfig, ReplayConfig, TrainConfig


@pytest.mark.parametrize("key, cls", [("optim", OptimConfig), ("train", TrainConfig), ("replay", ReplayConfig)])
def test_the_composed_config_is_the_schemas_defaults(key, cls):
    node = compose([])[key]
    assert set(node.keys()) == {f.name for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        value = node[f.name]
        default = getattr(cls(), f.name)
        assert (list(value) if f.name == "betas" else value) == (list(default) if f.name == "betas" else default), (
            f.name
        )


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: check_number("train.ppo_epochs", 0, 1, integer=True),
            r"^train\.ppo_epochs=0 is out of range: allowed \[1, inf\]",
        ),
        (
            lambda: check_number("rollout.group_size", "abc", 2, integer=True),
            r"^rollout\.group_size='abc' must be an integer$",
        ),
        (lambda: check_number("x.flag", True, 0), r"must be a number"),
        (lambda: check_number("optim.lr", 0.0, 0.0, low_open=True), r"allowed \(0\.0, inf\]"),
        (
            lambda: check_choice("advantage", "ppo", ["grpo", "dr_grpo"]),
            r"^advantage='ppo' is unknown: allowed \['dr_grpo', 'grpo'\]",
        ),
        (lambda: OptimConfig(lr=-1), r"^optim\.lr=-1"),
        (lambda: OptimConfig(betas=(0.9,)), r"optim\.betas"),
        (lambda: TrainConfig(tis_cap=0), r"^train\.tis_cap=0"),
        (lambda: TrainConfig(dynamic_sampling="yes"), r"^train\.dynamic_sampling='yes' must be true or false"),
        (lambda: ReplayConfig(is_cap=0.5), r"^replay\.is_cap=0\.5"),
    ],
)
def test_checks_name_the_key_once(make, message):
    with pytest.raises(ValueError, match=message) as err:
        make()
    key = message.lstrip("^").split("=")[0].split(r"\.")[0]
    assert str(err.value).count(key.replace("\\", "")) >= 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["advantage=ppo"], "advantage='ppo' is unknown: allowed ['batch_std', 'calibrated', 'dr_grpo', 'grpo']"),
        (["objective.clip_low=-1"], "objective.clip_low=-1 is out of range"),
        (["optim.lr=-1"], "optim.lr=-1.0 is out of range"),  # the schema made it a float
        (["optim.lr=fast"], "optim.lr='fast' must be a number"),  # types: the schema's, at composition
        (["train.ppo_epochs=1.5"], "train.ppo_epochs=1.5 must be an integer"),
        (["train.dynamic_sampling=maybe"], "train.dynamic_sampling='maybe' must be true or false"),
        (["train.ppo_epochs=0"], "train.ppo_epochs=0 is out of range"),
        (["replay.is_cap=0.5"], "replay.is_cap=0.5 is out of range"),
        (
            ["optim.max_tokens_per_micro_batch=100", "rollout.max_new_tokens=40", "data.max_prompt_tokens=512"],
            "optim.max_tokens_per_micro_batch=100 is smaller than the longest possible sequence, 552 tokens",
        ),
        (["model.gradient_checkpointing=yes"], "model.gradient_checkpointing='yes' must be true or false"),
        (
            ["backend.name=tpu"],
            "backend.name='tpu' is unknown: allowed ['cpu', 'cuda', 'cuda_compile', 'cuda_eager', 'cuda_model_step']",
        ),
        (["trainer=cpu", "backend.name=cuda"], "backend.name='cuda' computes on cuda, and this run on cpu"),
        (["backend.attention=flash"], "backend.attention='flash' is not an attention transformers knows: allowed auto"),
        (["backend.packing=yes"], "backend.packing='yes' is unknown: allowed ['auto', 'off', 'on']"),
        (
            ["trainer=cpu", "backend.disable=[decode_graphs]"],
            "backend.disable=['decode_graphs']: 'decode_graphs' is not a speed-up of the cpu backend "
            "(decode_graphs is a speed-up of cuda)",
        ),
        (["rollout.group_size=abc"], "rollout.group_size='abc' must be an integer"),
        (
            ["rollout.group_size=1"],
            "rollout.group_size=1 is out of range: allowed [2, inf] (an integer): advantage=grpo",
        ),
        (["trainer.max_steps=0"], "trainer.max_steps=0 is out of range"),
        (["data.prompts_per_step=0"], "data.prompts_per_step=0 is out of range"),
        (["overwrite=maybe"], "overwrite='maybe' must be true or false"),
    ],
)
def test_bad_values_fail_before_the_model_loads(overrides, message, monkeypatch, capsys):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(components, "load_policy", no_loading)
    assert main(["train", "model=tiny", "logger=none", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err
    key = message.split("=")[0]
    assert err.count(key + "=") == 1  # named once, not "objective (GRPO): objective.clip_low=..."


# keys whose choices the backend took over (backends/): same values, so no longer settings
REMOVED_KEYS = [
    "optim.packed_weights=false",
    "optim.logprob_chunk_size=0",
    "optim.logprob_keep_softmax_mib=0",
    "optim.share_prompts=false",
    "model.attn_implementation=eager",
    "model.recompute_elementwise=false",
    "model.recompute_up_proj=false",
    "model.reference_weights=file",
    "rollout.ahead_threads=2",
    "rollout.hf.packed_weights=false",
    "rollout.hf.drop_min_frac=0.5",
    "host.allocator=system",
    "host.keep_freed_memory=false",
]


@pytest.mark.parametrize("override", REMOVED_KEYS)
def test_a_removed_key_is_refused_as_unknown_before_the_model_loads(override, monkeypatch, capsys):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(components, "load_policy", no_loading)
    assert main(["train", "model=tiny", "logger=none", override]) == 2
    err = capsys.readouterr().err
    key = override.split("=")[0]
    assert f"unknown config key '{key}'; valid keys" in err


def test_the_backend_group_is_checked_and_has_no_removed_keys():
    cfg = compose([])
    assert set(cfg.backend.keys()) >= {"name", "attention"} and cfg.backend.name == "auto"
    for group, removed in [
        ("optim", {"packed_weights", "logprob_chunk_size", "logprob_keep_softmax_mib", "share_prompts"}),
        ("model", {"attn_implementation", "recompute_elementwise", "recompute_up_proj", "reference_weights"}),
        ("rollout", {"ahead_threads", "hf"}),
    ]:
        assert not removed & set(cfg[group].keys()), group
    assert "host" not in cfg


def test_a_registered_advantage_estimator_is_selectable_by_name():
    import torch

    @register_advantage("test_median")
    def median(r, eps):
        return r - r.median(-1, keepdim=True).values

    try:
        out = group_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 0.0]), 3, "test_median")
        assert out.tolist() == [-1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    finally:
        del ADVANTAGE_ESTIMATORS["test_median"]


def test_an_empty_data_file_is_refused_naming_the_file(tmp_path, monkeypatch, capsys):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(components, "load_policy", no_loading)
    empty = tmp_path / "train.jsonl"
    empty.write_text("")
    assert main(["train", "model=tiny", "logger=none", "data=files", f"data.train={empty}"]) == 2
    assert f"{empty}: the source holds no problems" in capsys.readouterr().err
