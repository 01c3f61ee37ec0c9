"""Models of published shapes (``workloads.SHAPES``), randomly initialised and saved once as local
model folders with the packaged SmolLM2 tokenizer (``harness.py models``), and the built-in task's
problems as a file (``harness.py problems``), for a machine without network or reasoning-gym.

A step's speed and memory do not depend on the weights' values, and a machine without network can
fetch none; responses run to a fixed length (EOS ignored) so that every run does the same work.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from common import copy_tokenizer
from workloads import SHAPES


def model_dir(shape: str, source: Path, root: Path, dtype: str, device: str) -> Path:
    """A randomly initialised model of ``shape`` under ``root`` (built once, seeded), its config's
    special tokens and its tokenizer from ``source`` (the packaged model's folder, or a copy of its
    small files)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / f"{shape}-{dtype}"
    if (out / "config.json").is_file():
        return out
    base = AutoConfig.from_pretrained(source)
    config = base if SHAPES[shape] is None else AutoConfig.for_model(**SHAPES[shape])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, key, getattr(base, key, None))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # initialised in the run's dtype: no float32 copy of a 7B model
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape}-", dir=root))
    model.save_pretrained(tmp)
    del model
    copy_tokenizer(source, tmp)
    tmp.rename(out)
    if device == "cuda":
        torch.cuda.empty_cache()  # the runs' processes get the whole GPU
    return out


def build(args) -> None:
    source = args.source
    if source is None:
        from ngrpo_lightning.models.loading import resolve_model_path

        source = Path(resolve_model_path("smollm2-135m-instruct"))
    device = "cuda" if args.accelerator == "gpu" else "cpu"
    for shape in args.shapes:
        print(model_dir(shape, source, args.models, args.dtype, device))


def export_problems(args) -> None:
    """The built-in task's training problems (the default run's) as JSON lines: problem, answer."""
    from ngrpo_lightning.build.data import build_problems
    from ngrpo_lightning.config import compose

    cfg = compose([])
    train, _ = build_problems(cfg.data, cfg.seed)
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text("".join(json.dumps({"problem": p.question, "answer": p.answer}) + "\n" for p in train))
    print(f"wrote {len(train)} problems to {args.path}")
