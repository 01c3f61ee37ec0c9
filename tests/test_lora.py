"""LoRA adapters (model.lora): checked settings, the reference from the same weights, a run
that trains and checkpoints the adapters only, and adapters that leave the framework."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_JOB, trained_lora

from ngrpo_lightning.checkpoints.safe_load import load_checkpoint
from ngrpo_lightning.commands.cli import main
from ngrpo_lightning.models import lora
from ngrpo_lightning.models.loading import load_policy

peft = pytest.importorskip("peft")

LORA_JOB = [
    *(o for o in TINY_JOB if not o.startswith("logger.")),
    "logger=none",
    "model.lora.enabled=true",
    "validate_before_fit=false",
    "data.val_size=0",
]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.lora.rank=0"], "model.lora.rank=0 is out of range"),
        (["model.lora.alpha=0"], "model.lora.alpha=0 is out of range"),
        (["model.lora.dropout=1.0"], "model.lora.dropout=1.0 is out of range: allowed [0.0, 1.0)"),
        (["model.lora.dropout=-0.1"], "model.lora.dropout=-0.1 is out of range: allowed [0.0, 1.0)"),
        (["+model.lora.rnak=8"], "model.lora has unknown keys ['rnak']"),
        (["model.lora.target_modules=[q_proj,qkv]"], "['qkv'] are not linear layers of LlamaForCausalLM"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(overrides, message, capsys, tmp_path):
    job = ["model=tiny", "logger=none", f"output_dir={tmp_path}", "model.lora.enabled=true"]
    assert main(["train", *job, *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err
    if "target_modules" in overrides[0]:  # the model's own linear layers are listed
        assert "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']" in err


def test_only_the_adapters_get_gradients():
    policy = lora.apply(load_policy("tiny")[0], lora.LoraSettings(enabled=True, rank=4))
    ids = torch.randint(0, 1000, (2, 10), generator=torch.Generator().manual_seed(2))
    policy(input_ids=ids).logits.float().log_softmax(-1).mean().backward()
    grads = {name: p.grad for name, p in policy.named_parameters() if p.grad is not None}
    assert grads and all(lora.is_adapter_weight(name) for name in grads)
    assert any(g.abs().sum() > 0 for name, g in grads.items() if "lora_B" in name)  # B = 0 at start: A's are 0


def test_the_reference_is_the_base_model_with_the_adapters_off():
    base, _ = load_policy("tiny")
    policy = trained_lora(std=0.5)  # trained adapters: the policy differs from its base
    ids = torch.randint(0, base.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = base(input_ids=ids).logits
        adapted = policy(input_ids=ids).logits
        with policy.disable_adapter():
            reference = policy(input_ids=ids).logits
    assert not torch.allclose(adapted, expected, atol=1e-3)
    torch.testing.assert_close(reference, expected, rtol=1e-6, atol=1e-6)
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter_weight(name) for name in trainable)


@pytest.mark.parametrize("lean", [False, True], ids=["peft's layers", "lean layers"])
def test_adapters_off_gives_peft_disable_adapters_outputs_and_puts_everything_back(lean):
    """``lora.adapters_off``: the base model's outputs, bit for bit those under peft's
    ``disable_adapter()``; afterwards the adapted outputs again, a layer that was off still off,
    and ``requires_grad`` never touched."""
    from ngrpo_lightning.backends import Backend

    policy = trained_lora(std=0.5)
    if lean:
        Backend().prepare(policy, trains=True)
    ids = torch.randint(0, policy.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    layers = [m for m in policy.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    layers[-1]._disable_adapters = True  # one layer off on its own, before and after
    grads = {name: p.requires_grad for name, p in policy.named_parameters()}
    with torch.no_grad():
        adapted = policy(input_ids=ids).logits
        with policy.disable_adapter():
            expected = policy(input_ids=ids).logits
        layers[-1]._disable_adapters = True  # peft's context turned every layer back on
        with lora.adapters_off(policy):
            assert all(m.disable_adapters for m in layers)
            assert {name: p.requires_grad for name, p in policy.named_parameters()} == grads
            reference = policy(input_ids=ids).logits
        after = policy(input_ids=ids).logits
    assert torch.equal(reference, expected) and not torch.allclose(reference, adapted, atol=1e-3)
    assert torch.equal(after, adapted)
    assert layers[-1].disable_adapters and not any(m.disable_adapters for m in layers[:-1])


def test_a_lora_run_trains_checkpoints_and_exports_the_adapters_only(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *LORA_JOB, "trainer.max_steps=2"]) == 0
    assert "  model:    tiny (float32, LoRA rank " in capsys.readouterr().out  # the header says it
    ckpt = load_checkpoint(tmp_path / "outputs/checkpoints/last.ckpt", mmap=False)
    keys = [k.removeprefix("policy.") for k in ckpt["state_dict"] if k.startswith("policy.")]
    layers = load_policy("tiny")[0].config.num_hidden_layers
    assert len(keys) == layers * 7 * 2 and all(lora.is_adapter_weight(k) for k in keys)  # A and B of 7 linears
    assert len(ckpt["optimizer_states"][0]["state"]) == len(keys)  # AdamW moments for the adapters only
    assert ckpt["ngrpo"]["base_model"]["weights_sha256"]

    assert main(["train", *LORA_JOB, "trainer.max_steps=3", "resume=last"]) == 0  # continues on the same base

    # the tiny random model earns no reward, so its adapters stay at B = 0: give them values, as
    # training would, to check that what leaves the framework is what the checkpoint holds
    path = tmp_path / "outputs/checkpoints/last.ckpt"
    ckpt = load_checkpoint(path, mmap=False)
    gen = torch.Generator().manual_seed(0)
    for key, value in ckpt["state_dict"].items():
        if "lora_B" in key:
            value.copy_(torch.randn(value.shape, generator=gen) * 0.5)
    torch.save(ckpt, path)

    assert main(["export", "outputs", "adapters", "--no-mlflow"]) == 0
    assert "load it: AutoModelForCausalLM.from_pretrained('adapters') (with peft installed" in capsys.readouterr().out
    assert main(["export", "outputs", "merged", "--no-mlflow", "--merge"]) == 0
    assert (Path("adapters") / "adapter_config.json").exists() and not (Path("adapters") / "config.json").exists()
    assert "LoRA adapters in peft's format" in (Path("adapters") / "README.md").read_text()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(1))
    from transformers import AutoModelForCausalLM

    from ngrpo_lightning.checkpoints.trained_policy import find_checkpoint, load_trained_policy, read_checkpoint

    trained, _ = load_trained_policy(read_checkpoint(find_checkpoint("outputs")))
    outside = peft.PeftModel.from_pretrained(load_policy("tiny")[0], "adapters")
    merged = AutoModelForCausalLM.from_pretrained("merged")
    as_printed = AutoModelForCausalLM.from_pretrained("adapters")  # the export's hint: transformers finds the base
    ours = load_policy("adapters")[0]  # what `ngrpo eval model=adapters` and `ngrpo train` load: merged
    assert not lora.has_adapters(ours)
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        torch.testing.assert_close(outside(input_ids=ids).logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(as_printed(input_ids=ids).logits, expected, rtol=0, atol=0)
        for model in (merged, ours):
            torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(load_policy("tiny")[0](input_ids=ids).logits, expected, atol=1e-4)

    # copied to another machine, the adapters name a cache folder that is not there: the built-in
    # model their card names is loaded (that machine's build of it); a folder the card does not
    # name as its base stays a missing base
    config = json.loads(Path("adapters/adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "elsewhere" / ".cache" / "tiny")
    Path("adapters/adapter_config.json").write_text(json.dumps(config))
    with torch.no_grad():
        torch.testing.assert_close(load_policy("adapters")[0](input_ids=ids).logits, ours(input_ids=ids).logits)
    card = Path("adapters/README.md")
    card.write_text(card.read_text().replace("| base model | `tiny` |", "| base model | `mine` |"))
    with pytest.raises(FileNotFoundError, match="holds LoRA adapters of the base model .*elsewhere"):
        load_policy("adapters")


def test_resume_on_a_changed_base_model_is_refused_naming_both(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base, tokenizer = load_policy("tiny")
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    job = [*LORA_JOB, f"model.name_or_path={tmp_path / 'base'}"]
    assert main(["train", *job, "trainer.max_steps=1"]) == 0
    with torch.no_grad():
        base.model.embed_tokens.weight.add_(0.01)  # another base model under the same name
    base.save_pretrained(tmp_path / "base")
    assert main(["train", *job, "trainer.max_steps=2", "resume=last"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume: the checkpoint's reference is the base model" in err
    assert err.count("weights sha256") == 2  # the checkpoint's base and this run's, both named
    # eval and export load the adapters on the base model the same way, and refuse it the same way
    assert main(["eval", "model=outputs", "n=1", "limit=1", "max_new_tokens=2", "logger=none"]) == 2
    err = capsys.readouterr().err
    assert "cannot eval: the checkpoint's reference is the base model" in err and err.count("weights sha256") == 2
    assert main(["export", "outputs", str(tmp_path / "hf"), "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert "cannot export: the checkpoint's reference is the base model" in err and err.count("weights sha256") == 2
    assert not (tmp_path / "hf").exists()


def test_the_ngrpo_lora_preset_trains_with_neighbor_mixing(tmp_path, monkeypatch):
    from ngrpo_lightning.config import compose

    cfg = compose(["experiment=ngrpo-lora"])
    assert cfg.model.lora.enabled and cfg.explorer.name == "neighbor" and cfg.objective.name == "grpo"
    monkeypatch.chdir(tmp_path)
    job = [o for o in LORA_JOB if o != "model.lora.enabled=true"]
    assert main(["train", "experiment=ngrpo-lora", *job, "trainer.max_steps=1"]) == 0
    ckpt = load_checkpoint(tmp_path / "outputs/checkpoints/last.ckpt", mmap=False)
    assert all(lora.is_adapter_weight(k.removeprefix("policy.")) for k in ckpt["state_dict"] if k.startswith("policy."))
