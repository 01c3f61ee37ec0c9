"""Tests for ngrpo_lightning.models.loading (policy + tokenizer loading).

Built-in models are cached under $NGRPO_CACHE (or the default cache dir); the first run
downloads and converts SmolLM2 once (~30 s), later runs reuse it.
"""

import multiprocessing as mp
import time

import pytest
import torch

from ngrpo_lightning.models import loading
from ngrpo_lightning.models.loading import (
    BUILTIN_MODELS,
    cache_dir,
    load_policy,
    load_tokenizer,
    packaged_model_dir,
    parse_dtype,
    resolve_model_path,
)

SMOL_PARAMS = 134_515_008  # SmolLM2-135M: 30 layers x 576 hidden, tied 49152-token embeddings


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------- names, paths, dtypes
def test_builtin_names():
    assert BUILTIN_MODELS == ("smollm2-135m-instruct", "tiny")


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
    ],
)
def test_parse_dtype_aliases(name, dtype):
    assert parse_dtype(name) is dtype


def test_bad_dtype_names_config_key_and_allowed_values():
    with pytest.raises(ValueError) as err:
        parse_dtype("float64")
    msg = str(err.value)
    assert "model.dtype" in msg and "float64" in msg
    for allowed in ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16"):
        assert allowed in msg
    with pytest.raises(ValueError, match="model.dtype"):
        load_policy("tiny", dtype="int8")


@pytest.mark.parametrize("rel", ["/definitely/not/here", "./not-here", "~/not-here-either", "some/nested/dir"])
def test_missing_path_names_path_and_builtins(rel):
    with pytest.raises((FileNotFoundError, ValueError)) as err:
        resolve_model_path(rel)
    msg = str(err.value)
    assert rel in msg and "smollm2-135m-instruct" in msg and "tiny" in msg


def test_missing_absolute_tmp_path(tmp_path):
    missing = str(tmp_path / "no-model")
    with pytest.raises(FileNotFoundError, match="no-model"):
        load_policy(missing)


def test_dir_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_path(str(tmp_path))


def test_hub_ids_pass_through_unchanged():
    for hub_id in ("HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "Qwen/Qwen2.5-0.5B-Instruct"):
        assert resolve_model_path(hub_id) == hub_id


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("NGRPO_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("NGRPO_CACHE")
    assert cache_dir().name == "ngrpo-lightning"


def _fake_build(out):
    with open(out.parent / "builds.txt", "a") as fh:  # counts how many processes built
        fh.write("built\n")
    time.sleep(0.5)
    (out / "config.json").write_text("{}")


def _ensure_fake(_):
    return str(loading._ensure_built("fake", _fake_build))


def test_concurrent_builds_run_once(monkeypatch, tmp_path):
    monkeypatch.setenv("NGRPO_CACHE", str(tmp_path))
    with mp.get_context("fork").Pool(4) as pool:
        dirs = pool.map(_ensure_fake, range(4))
    assert set(dirs) == {str(tmp_path / "fake")}
    assert (tmp_path / "builds.txt").read_text().count("built") == 1
    assert not list(tmp_path.glob(".tmp-fake-*"))  # the temp build dir was renamed into place


# ---------------------------------------------------------------- tiny
@pytest.fixture(scope="module")
def tiny():
    return load_policy("tiny")


def test_tiny_loads_fast_and_deterministically(tiny):
    first, _ = tiny
    times, states = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        model, _ = load_policy("tiny")
        times.append(time.perf_counter() - t0)
        states.append(_state(model))
    assert min(times) < 1.0, times
    _assert_same(states[0], states[1])
    _assert_same(states[0], _state(first))


def test_tiny_build_is_seeded(tmp_path, tiny):
    rng = torch.get_rng_state()
    loading._build_tiny(tmp_path)  # a fresh build gives the cached weights again
    assert torch.equal(rng, torch.get_rng_state())  # and leaves the caller's RNG alone
    rebuilt = loading.AutoModelForCausalLM.from_pretrained(tmp_path)
    _assert_same(_state(rebuilt), _state(tiny[0]))


def test_tiny_shape_and_tokenizer(tiny):
    model, tok = tiny
    assert model.config.vocab_size == 49152 == len(tok)
    assert model.config.num_hidden_layers == 2 and model.config.tie_word_embeddings
    assert model.dtype == torch.float32 and model.training
    assert "<|im_start|>" in tok.chat_template
    assert tok.padding_side == "left"
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert (packaged_model_dir("tiny") / "model.safetensors").is_file()


def test_tokenizer_splits_digits_like_smollm2():
    tok = load_tokenizer("tiny")
    assert tok.convert_ids_to_tokens(tok("12345").input_ids) == list("12345")
    assert tok.convert_ids_to_tokens(tok("x\n\n1").input_ids) == ["x", "ĊĊ", "1"]


def test_tiny_batched_generate(tiny):
    model, tok = tiny
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in ("Hi", "What is 2+3? Think.")
    ]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert (batch["input_ids"][0, 0] == tok.pad_token_id).item()  # left padded
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, batch["input_ids"].shape[1] + 4)


# ---------------------------------------------------------------- packaged SmolLM2
@pytest.fixture(scope="module")
def smol():
    return load_policy("smollm2-135m-instruct")


@pytest.mark.slow
def test_packaged_dir_contents():
    import json

    d = packaged_model_dir()
    assert d == cache_dir() / "smollm2-135m-instruct"
    assert (d / "model.safetensors").is_file()
    config = json.loads((d / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    assert "quantization_config" not in config
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.slow
def test_packaged_model_params_and_dtype(smol):
    model, tok = smol
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - SMOL_PARAMS) / SMOL_PARAMS < 0.01, n
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0


@pytest.mark.slow
def test_packaged_model_answers_simple_sum(smol):
    model, tok = smol
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    model.eval()
    try:
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=32, do_sample=False)
    finally:
        model.train()
    reply = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert reply.strip() and "5" in reply, reply


@pytest.mark.slow
def test_packaged_model_bf16():
    model, _ = load_policy("smollm2-135m-instruct", dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
