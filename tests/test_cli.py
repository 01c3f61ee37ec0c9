"""Bad input gets one clear error naming the problem; nothing is trained."""

import json
import subprocess
import sys

import pytest

from ngrpo_lightning.commands.cli import main


def run_error(capsys, *args):
    assert main(list(args)) == 2
    return capsys.readouterr().err


def test_unknown_key_lists_valid_keys(capsys):
    err = run_error(capsys, "train", "optim.learning_rate=1e-5")
    assert "optim.learning_rate" in err and "'lr'" in err and "'warmup_steps'" in err


def test_unknown_group_option_lists_options(capsys):
    err = run_error(capsys, "train", "explorer=bogus")
    assert "bogus" in err and "temperature" in err
    assert "Config search path" not in err  # Hydra's internals, not the user's
    err = run_error(capsys, "train", "explorer=my_mod.MyExplorer")
    assert "my_mod.MyExplorer looks like a class path: give it as explorer._target_=my_mod.MyExplorer" in err


def test_a_mistyped_group_option_says_which_it_nears(capsys):
    assert main(["train", "experiment=ngrpoo"]) == 2
    err = capsys.readouterr().err
    assert "Could not find 'experiment/ngrpoo': did you mean experiment=ngrpo?" in err and "\tstht" in err
    assert main(["train", "experiment=zzzz"]) == 2
    assert "did you mean" not in capsys.readouterr().err  # nothing near: the list alone


def test_missing_model_path_is_named(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output_dir, outputs/, may hold a run of `make train`
    missing = tmp_path / "no_model_here"
    err = run_error(capsys, "train", "model=hf", f"model.name_or_path={missing}", "logger=none")
    assert str(missing) in err
    # out/nope with a folder out/ here is a path, not a Hub id (a minute of retries, then a traceback)
    (tmp_path / "out").mkdir()
    err = run_error(capsys, "eval", "model=out/nope", "logger=none")
    assert "model.name_or_path='out/nope': no such model directory" in err


def test_malformed_data_file_names_file_and_line(capsys, tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n{not json\n")
    err = run_error(capsys, "train", "model=tiny", "data=files", f"data.train={bad}", "logger=none")
    assert "train.jsonl:2" in err
    bad.write_text('{"problem": "1+1", "answer": "2"\n')  # its closing brace missing: the line's end, not column 1
    err = run_error(capsys, "train", "model=tiny", "data=files", f"data.train={bad}", "logger=none")
    assert "train.jsonl:1: malformed JSON line (Expecting ',' delimiter at column 33)" in err


def test_missing_answer_field_is_named(capsys, tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps({"problem": "1+1", "solution": "2"}) + "\n")
    err = run_error(capsys, "train", "model=tiny", "data=files", f"data.train={bad}", "logger=none")
    assert "answer" in err and "solution" in err


def test_required_value_is_named(capsys):
    err = run_error(capsys, "train", "data=files")
    assert "data.train" in err


def test_bad_dtype_is_named(capsys):
    err = run_error(capsys, "train", "model=tiny", "model.dtype=float8", "logger=none")
    assert "model.dtype" in err


def test_an_unknown_accelerator_is_named_with_lightnings_names(capsys):
    assert main(["train", "model=tiny", "trainer.accelerator=gpuu", "logger=none"]) == 2
    err = capsys.readouterr().err
    assert "trainer.accelerator='gpuu' is unknown: allowed [" in err and "'cpu'" in err and "'gpu'" in err


def test_several_processes_without_fsdp2_point_to_its_presets(capsys):
    """trainer.devices=2 on the cpu preset would run Lightning's DDP, which the module does not train
    under (it crashed in DDP's first broadcast): refused, naming the FSDP2 preset."""
    err = run_error(capsys, "train", "model=tiny", "trainer.devices=2", "logger=none")
    assert "trainer.devices=2 (2 processes) without trainer.parallel would run Lightning's DDP" in err
    assert err.rstrip().endswith("use trainer=fsdp_cpu")
    err = run_error(capsys, "train", "model=tiny", "+trainer.strategy=ddp", "logger=none")
    assert "trainer.strategy=ddp without trainer.parallel" in err


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.parametrize("seed, message", [("x", "seed='x' must be an integer"), ("-1", "seed=-1 is out of range")])
def test_a_bad_seed_is_named(capsys, command, seed, message):
    assert message in run_error(capsys, command, "model=tiny", f"seed={seed}", "logger=none")


@pytest.mark.parametrize(
    "command, key", [("train", "rollout.max_new_tokens"), ("eval", "max_new_tokens")], ids=["train", "eval"]
)
def test_a_response_longer_than_the_models_context_is_refused_when_it_loads(capsys, tmp_path, command, key):
    """The tiny model's context is 8192 tokens: 4096 of prompt and 100000 new ones would have
    allocated a KV cache of 104096 positions (HF engine), or failed deep inside vLLM."""
    err = run_error(capsys, command, "model=tiny", f"{key}=100000", "logger=none", f"output_dir={tmp_path}")
    assert (
        f"data.max_prompt_tokens=4096 + {key}=100000 = 104096 tokens, longer than the model's context, 8192 tokens "
        f"(max_position_embeddings in its config): lower {key} to at most 4096, or data.max_prompt_tokens" in err
    )
    assert not (tmp_path / "checkpoints").exists()


def test_a_character_overrides_cannot_read_unquoted_is_named_with_how_to_quote_it(capsys):
    err = run_error(capsys, "diagnose", "drift", "model=tiny", "tokens=[7,+,' the',Ġthe]")
    assert "cannot read the override tokens=[7,+,' the',Ġthe]: the character 'Ġ' must be inside quotes" in err
    assert "LexerNoViableAltException" not in err


def test_bad_engine_setting_is_named_before_the_model_loads(capsys):
    # rollout.hf.* is not in the config any more (the backend decides), but HFEngine's own settings
    # can still be given, and are checked
    err = run_error(capsys, "train", "model=tiny", "+rollout.hf.drop_min_frac=2", "logger=none")
    assert "rollout.hf.drop_min_frac=2 is out of range: allowed [0.0, 1.0]" in err


@pytest.mark.parametrize(
    "override, message",
    [
        ("+rollout.hf.drop_finished_rows=maybe", "rollout.hf.drop_finished_rows='maybe' must be true or false"),
        ("+rollout.hf.pack=true", "rollout.hf.pack is unknown: allowed ['drop_finished_rows', 'drop_min_frac']"),
        (
            "+rollout.hf.packed_weights=false",  # the backend's choice now
            "rollout.hf.packed_weights is unknown: allowed ['drop_finished_rows', 'drop_min_frac']",
        ),
        ("rollout.hf.packed_weights=false", "unknown config key 'rollout.hf.packed_weights'; valid keys of rollout"),
        ("rollout.ignore_eos=2", "rollout.ignore_eos=2 must be true or false"),
        ("rollout.engine=nope", "rollout.engine='nope' is unknown: allowed ['hf',"),
        ("rollout.engine=no_such.Engine", "rollout.engine='no_such.Engine' cannot be imported"),
        ("rollout.engine=ngrpo_lightning.rollout.RolloutBatch", "is not a subclass of"),
    ],
)
def test_bad_hf_engine_keys_are_named(capsys, override, message):
    assert message in run_error(capsys, "train", "model=tiny", override, "logger=none")


def test_help_lists_groups(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "explorer" in out and "temperature" in out and "experiment" in out


@pytest.mark.parametrize(
    "command, groups, keys",
    [
        ("eval", ["model", "data", "logger"], ["n:", "ks:", "checkpoint:"]),
        ("compare", ["logger"], ["sweep:", "detect:"]),
    ],
)
def test_a_commands_help_describes_its_own_config(capsys, command, groups, keys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.split("Examples:")[0].splitlines()[1:] if line.startswith("  ")]
    assert listed == groups  # train's explorer, objective, ... are not the command's
    assert all(f"\n  {key}" in out for key in keys) and f"ngrpo {command} " in out


def test_config_prints_composed_yaml(capsys):
    assert main(["config", "experiment=grpo", "optim.lr=3e-6"]) == 0
    out = capsys.readouterr().out
    assert "lr: 3.0e-06" in out and "experiment_name: grpo" in out


@pytest.mark.parametrize(
    "argv, code",
    [
        (["train", "--help"], 0),
        (["config", "experiment=ngrpo"], 0),
        (["train", "explorer=bogus"], 2),
        (["eval", "nn=8"], 2),
        (["compare", "sweeep=s1"], 2),
    ],
)
def test_cheap_paths_answer_before_torch_loads(argv, code):
    # help, the composed config and a config that does not compose need neither torch nor
    # Lightning (5-6 s of imports): a fresh process shows they were never loaded
    script = (
        "import sys; from ngrpo_lightning.commands.cli import main; code = main(sys.argv[1:]); "
        "heavy = sorted({'torch', 'lightning', 'transformers', 'mlflow'} & set(sys.modules)); "
        "print('heavy:', heavy, file=sys.stderr); sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert "heavy: []" in done.stderr


def test_unknown_rollout_engine_is_a_config_error(capsys):
    assert main(["train", "model=tiny", "rollout.engine=fast"]) == 2
    err = capsys.readouterr().err
    assert "rollout.engine='fast' is unknown" in err and "vllm" in err


@pytest.mark.parametrize("entry", ["ngrpo_lightning.commands.cli", "ngrpo_lightning.commands.launch"])
def test_the_program_exits_with_the_commands_status_after_its_exit_handlers(tmp_path, entry):
    # the program ends without the collector's last walk (gc.freeze, cli.exit_after) but keeps
    # the rest of the interpreter's exit: handlers registered during the command still run, in
    # the frozen interpreter, and the status is the command's
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import atexit, gc, runpy, sys\n"
        "atexit.register(lambda: print('handler ran; frozen objects:', gc.get_freeze_count() > 0))\n"
        f"sys.argv = ['ngrpo', *sys.argv[1:]]; runpy.run_module({entry!r}, run_name='__main__')\n"
    )
    for argv, code in ((["config", "experiment=ngrpo"], 0), (["train", "explorer=bogus"], 2)):
        done = subprocess.run([sys.executable, str(probe), *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == code, done.stderr
        assert "handler ran; frozen objects: True" in done.stdout
    import tomllib
    from pathlib import Path

    root = Path(__file__).parents[1]  # the installed ngrpo command is the launcher script, which runs launch:program
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["script-files"] == ["ngrpo_lightning/commands/bin/ngrpo"]
    assert "ngrpo" not in project["project"].get("scripts", {})
    launcher = (root / "ngrpo_lightning/commands/bin/ngrpo").read_text()
    assert 'exec "$python" -m ngrpo_lightning.commands.launch "$@"' in launcher


def test_a_class_path_may_name_a_module_in_the_current_directory_without_shadowing_packages(tmp_path, capsys):
    # the `ngrpo` program does not put the current directory on the import path as `python -m`
    # does (-P: neither does this process); the command appends it, after the installed packages
    (tmp_path / "my_explorer.py").write_text(
        "from ngrpo_lightning.explorers import TemperatureExplorer\n\n\nclass Mine(TemperatureExplorer):\n    pass\n"
    )
    (tmp_path / "omegaconf.py").write_text("raise ImportError('a file of the directory shadowed a package')\n")
    script = "import sys; from ngrpo_lightning.commands.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["train", "explorer._target_=my_explorer.Mine", "explorer.nope=1", "model=tiny", "logger=none"]
    done = subprocess.run(
        [sys.executable, "-P", "-c", script, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr
    assert "explorer.nope is not a parameter of Mine" in done.stderr  # imported from the directory
    assert main(["train", "explorer._target_=not_here.Mine", "model=tiny", "logger=none"]) == 2
    assert "No module named 'not_here' (the module must be importable: a file in the current directory" in (
        capsys.readouterr().err
    )
