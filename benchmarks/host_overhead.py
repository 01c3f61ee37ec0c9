"""The host's share of a step, measured where the arithmetic costs nothing: the packaged model's
structure (its 30 decoder layers, its attention and MLP modules, its tokenizer's chat prompts) at
a width of 16 and a vocabulary of 1,024 (the prompts' token ids taken modulo it), randomly
initialised, full fine-tuning against LoRA, on the CPU.

A GPU step of a small model is bound by its host: Python, the dispatcher and kernel launches,
not the device's arithmetic. At a width of 16 the CPU's arithmetic is negligible too, so the
times below are the host's work per pass (dispatcher and Python, launches aside), and a cost
that scales with the model's modules rather than its width shows up as it would on a GPU.
A peft model has 2,499 modules where the plain one has 397: per-pass walks over them, and
peft's own Python, cost LoRA what the device does not (docs/performance.md, "The host's share").

Phases, each the median of ``--repeats`` after a warm-up, with the Python function calls of one
run beside it (the host's work counted, where the times of a shared machine are noisy): the
rollout (6 prompts x 2 samples x 8 tokens on a static cache, as the CUDA backend decodes, without
its graphs), the reference pass (``RLModule.prepare``: the KL reference's log-probs; LoRA's is the
policy with its adapters off) and the update on the rollout's rows, its forward alone and with
its backward. The bookkeeping rows time
what a pass or rollout does around the model: ``tensor_addresses`` (a rollout replaying CUDA
graphs checks them), the switch to eval mode and back (every rollout), ``adapters_off`` and
``packed_for_pass`` (every pass).

    python benchmarks/host_overhead.py
    python benchmarks/host_overhead.py --dtype bfloat16   # a GPU run's dtypes: LoRA's fused product
    python benchmarks/host_overhead.py --dtype bfloat16 --modules cuda   # and the CUDA backend's modules
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, arithmetic_prompt_ids, copy_tokenizer, print_table, write_json  # noqa: E402
from update_ops import KeepingActivations  # noqa: E402

from ngrpo_lightning.backends.base import Backend  # noqa: E402
from ngrpo_lightning.backends.passes import packed_for_pass  # noqa: E402
from ngrpo_lightning.backends.recompute import recomputing  # noqa: E402
from ngrpo_lightning.explorers import TemperatureExplorer  # noqa: E402
from ngrpo_lightning.models import lora  # noqa: E402
from ngrpo_lightning.models.loading import load_policy, resolve_model_path  # noqa: E402
from ngrpo_lightning.models.walks import set_training  # noqa: E402
from ngrpo_lightning.objectives import GRPO  # noqa: E402
from ngrpo_lightning.rollout import HFEngine  # noqa: E402
from ngrpo_lightning.rollout.decode_graphs import tensor_addresses  # noqa: E402
from ngrpo_lightning.training.module import RLModule  # noqa: E402
from ngrpo_lightning.training.updates import StepRollouts  # noqa: E402

NARROW = dict(
    hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=1024
)


def narrow_model(source: str, root: Path) -> Path:
    """The source model's configuration narrowed (:data:`NARROW`; its layers and tokenizer kept), saved once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / "narrow"
    if not (out / "config.json").is_file():
        config = AutoConfig.from_pretrained(source)
        for key, value in NARROW.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
        copy_tokenizer(Path(source), out)
    return out


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def python_calls(fn) -> int:
    """How many Python function calls one run of ``fn`` makes: the host's work counted, where
    its time is noisy."""
    profile = cProfile.Profile()
    profile.runcall(fn)
    return pstats.Stats(profile).total_calls


def measure(path: Path, mode: str, repeats: int, dtype: str = "float32", modules: str = "base") -> list[dict]:
    policy, tok = load_policy(str(path), dtype=dtype, attn_implementation="sdpa")
    reference = None
    if mode == "LoRA":
        policy = lora.apply(policy, lora.LoraSettings(enabled=True, rank=16, alpha=32, target_modules="all-linear"))
    else:
        reference = copy.deepcopy(policy)
    backend = KeepingActivations(policy.dtype) if modules == "cuda" else Backend(dtype=policy.dtype)
    backend.on_device(backend.prepare(policy, trains=True))
    if reference is not None:  # as a run prepares the frozen reference (and joins it on its device)
        backend.on_device(backend.prepare(reference))
    module = RLModule(
        policy, tok, TemperatureExplorer(temperature=1.0), GRPO(kl_coef=0.01), lambda texts, answers: None,
        reference=reference, adapters=mode == "LoRA", backend=backend,
    )  # fmt: skip
    engine = HFEngine(policy, tok, max_new_tokens=8, seed=0, backend=backend, static_cache=True, graphs=False)
    prompts = [[i % NARROW["vocab_size"] for i in ids] for ids in arithmetic_prompt_ids(tok, 6)]
    explorer = TemperatureExplorer(temperature=1.0)
    batch = engine.generate(prompts, explorer, n=2)
    step = StepRollouts.fresh(batch, torch.tensor([1.0, 0.0] * 6), tok.pad_token_id or 0)
    step.advantages = torch.tensor([1.0, -1.0] * 6)

    trained = [p for p in policy.parameters() if p.requires_grad]

    def update():  # as RLModule's update runs a micro-batch: the cheap activations recomputed in backward
        with recomputing():
            logp, _ = module._logprobs(policy, step.batch, 1.0, with_entropy=True)
        (logp * step.batch.response_mask).sum().backward()
        for p in trained:  # as the optimizer's zero_grad: its parameters' list, not a walk of the modules
            p.grad = None

    def update_forward():  # the same forward alone (its graph dropped)
        with recomputing():
            module._logprobs(policy, step.batch, 1.0, with_entropy=True)

    def eval_and_back():  # as a rollout switches (models/walks.py)
        set_training(policy, False)
        set_training(policy, True)

    def adapters_off():
        with lora.adapters_off(policy):
            pass

    def a_pass():
        with packed_for_pass(policy, rows=12):
            pass

    times = {
        "rollout": lambda: engine.generate(prompts, explorer, n=2),
        "reference pass": lambda: module.prepare(step, reuse_forward=True),
        "update forward": update_forward,
        "update forward and backward": update,
        "tensor_addresses": lambda: tensor_addresses(policy),
        "eval() and train()": eval_and_back,
        "packed_for_pass, entered and left": a_pass,
    }
    if mode == "LoRA":
        times["adapters_off, entered and left"] = adapters_off
    modules = sum(1 for _ in policy.modules())
    return [
        {"mode": mode, "modules": modules, "what": k, "ms": median_ms(fn, repeats), "python calls": python_calls(fn)}
        for k, fn in times.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the structure to narrow")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"],
        help="the model's; LoRA's adapters stay float32 (peft's default): bfloat16 is a GPU run's case",
    )  # fmt: skip
    ap.add_argument(
        "--modules", default="base", choices=["base", "cuda"],
        help="the base backend's (what every device gets) or the CUDA backend's (fused, joined) modules",
    )  # fmt: skip
    ap.add_argument("--out", default=str(RESULTS / "host_overhead.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core: the host's Python is single-threaded
    with tempfile.TemporaryDirectory() as tmp:
        path = narrow_model(resolve_model_path(args.model), Path(tmp))
        rows = [row for mode in ("full", "LoRA") for row in measure(path, mode, args.repeats, args.dtype, args.modules)]
    full = {r["what"]: r["ms"] for r in rows if r["mode"] == "full"}
    for row in rows:
        row["x full's"] = round(row["ms"] / full[row["what"]], 2) if row["what"] in full else None
        row["ms"] = round(row["ms"], 2)
    shape = f"{args.model}'s structure at width 16, vocabulary 1,024, {args.dtype}, {args.modules} modules, one thread"
    print(f"{shape}: milliseconds, median of {args.repeats}")
    print_table(rows, ["mode", "modules", "what", "ms", "x full's", "python calls"])
    meta = dict(model=args.model, width=NARROW, threads=1, dtype=args.dtype, modules=args.modules)
    write_json("host_overhead", rows, args.out, **meta)


if __name__ == "__main__":
    main()
