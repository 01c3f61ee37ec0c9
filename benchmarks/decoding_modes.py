"""Decoding modes of HFEngine side by side: the growing KV cache, the static cache, and the static
cache with each step replayed from a CUDA graph recorded as it runs (``graphs``, a GPU only) or
compiled by ``torch.compile`` (``compile``: CUDA graphs of Inductor's kernels on a GPU; on a CPU
compiled code only), against the bandwidth floor. ``graphs-sdpa`` records the graphs with
transformers' own ``sdpa`` attention instead of the backends' ``sdpa_gqa``: on a GPU, given a
mask, it copies every grouped key and value head once per query head at each step.
``graphs-model`` records the model's step alone, the explorer, sampling and bookkeeping launched
between replays (as for an explorer that does not declare capturable; ``graphs`` records the whole
step: ``rollout/step_graphs.py``). ``graphs-efficient`` and ``graphs-math`` record the
steps with PyTorch's memory-efficient attention kernel or its matmuls instead of the kernel it
picks itself (cuDNN's on an H100, 13 us per layer and step at the 1.5B shape for about 2 us of
keys and values to read). ``graphs-unfused`` (and ``static-unfused``, its eager step)
records them with transformers' own norms, attention and MLPs in place of the CUDA backend's fused
ones (``backends/fused.py``): the kernels those save, measured in the same process.

Every mode decodes the same prompts greedily for exactly ``--new-tokens`` tokens per row (EOS
suppressed), fastest of ``--repeats`` runs, interleaved, each mode on one engine all along (it
keeps its static cache and graphs, as in training); the first run of each mode (and its graph
recording) is a warm-up and is reported apart, and a later run's recording time (none expected:
the graphs are kept) is reported too. Tokens must equal the growing cache's,
log-probs agree up to float rounding. The floor of a decoding step is the bytes it must read
(every weight once, and each row's keys and values so far) over the memory bandwidth
(``--bandwidth-gbs``; the H100 SXM's is 3,350 GB/s).

    python benchmarks/decoding_modes.py --device cuda --dtype bfloat16 --bandwidth-gbs 3350
    python benchmarks/decoding_modes.py --model /tmp/large-shapes/qwen2.5-1.5b-bfloat16 --device cuda \\
        --dtype bfloat16 --new-tokens 256 --bandwidth-gbs 3350
    python benchmarks/decoding_modes.py            # CPU: growing against static (no graphs)
    python benchmarks/decoding_modes.py --device cuda --dtype bfloat16 --modes static graphs compile

The tokens are compared with the first mode's (growing, unless ``--modes`` leaves it out). A mode
that fails (its graphs cannot be recorded, say) is reported with its error; the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, arithmetic_prompt_ids, print_table, write_json  # noqa: E402

from ngrpo_lightning.backends import backend_for  # noqa: E402
from ngrpo_lightning.backends.fused import FusedGatedMLP, FusedRMSNorm, FusedRotaryAttention  # noqa: E402
from ngrpo_lightning.backends.swap import original_class  # noqa: E402
from ngrpo_lightning.explorers import TemperatureExplorer  # noqa: E402
from ngrpo_lightning.models.loading import load_policy  # noqa: E402
from ngrpo_lightning.rollout import HFEngine  # noqa: E402

# --modes name -> (the table's name, HFEngine's settings)
MODES = {
    "growing": ("growing", {"static_cache": False}),
    "static": ("static", {"static_cache": True, "graphs": False}),  # eager, whatever the backend's default
    "graphs": ("static + graphs", {"static_cache": True, "graphs": "cuda"}),
    # the model's step alone recorded: the explorer and the bookkeeping launched between replays (an
    # explorer that does not declare capturable), the way every step ran before whole steps were recorded
    "graphs-model": ("static + graphs, model step only", {"static_cache": True, "graphs": "cuda"}),
    # transformers' own sdpa: on a GPU it copies each grouped key and value head per query head
    # (repeat_kv) where sdpa_gqa, the default, stacks the query heads (attention.stacked_decoding_attention)
    "graphs-sdpa": ("static + graphs, transformers' sdpa", {"static_cache": True, "graphs": "cuda"}),
    "compile": ("static + compile", {"static_cache": True, "graphs": "compile"}),
    # the decoding step's attention kernel chosen by hand (torch.nn.attention.sdpa_kernel), where
    # PyTorch's choice on an H100 was cuDNN's, 13 us per layer for 32 rows at the 1.5B shape
    "graphs-efficient": ("static + graphs, memory-efficient attention", {"static_cache": True, "graphs": "cuda"}),
    "graphs-math": ("static + graphs, attention as matmuls", {"static_cache": True, "graphs": "cuda"}),
    # transformers' norms, attention and MLPs instead of the backend's fused ones (their classes put back)
    "graphs-unfused": ("static + graphs, unfused", {"static_cache": True, "graphs": "cuda"}),
    "static-unfused": ("static, unfused", {"static_cache": True, "graphs": False}),
}
MODEL_STEP_ONLY = {MODES["graphs-model"][0]}
ATTENTION = {"graphs-sdpa": "sdpa"}  # a mode's attention, where not the model's default
UNFUSED = {MODES["graphs-unfused"][0], MODES["static-unfused"][0]}
KERNEL = {  # a mode's attention kernels, where not PyTorch's own choice
    MODES["graphs-efficient"][0]: [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    MODES["graphs-math"][0]: [SDPBackend.MATH],
}


class Uncaptured(TemperatureExplorer):
    """Greedy decoding with a step of its own that does not declare capturable: only the model's
    step is recorded."""

    def step(self, logits, generator=None):
        return super().step(logits, generator)


def floor_ms(model, rows: int, prompt: int, new: int, bandwidth_gbs: float) -> float:
    """Mean bytes a decoding step reads (weights + keys and values so far) / bandwidth, in ms."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config.get_text_config(decoder=True)
    heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * heads * head_dim * next(model.parameters()).element_size()
    mean_length = prompt + new / 2
    return (weights + rows * mean_length * per_token) / (bandwidth_gbs * 1e9) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bandwidth-gbs", type=float, default=None)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=None, help="default: all but compile")
    ap.add_argument("--problems", default="", help="a .jsonl of problems instead of the built-in task")
    ap.add_argument("--out", default=str(RESULTS / "decoding_modes.json"))
    args = ap.parse_args()
    model, tok = load_policy(args.model, dtype=args.dtype)
    model = model.to(args.device)
    # torch.compile cannot trace the CPU backend's packed products: compared on plain ones there
    backend = backend_for(model)
    if "compile" in (args.modes or []) and not args.device.startswith("cuda"):
        backend = type(backend)(backend.dtype, packing="off")
    backend.on_device(backend.prepare(model, trains=True))  # as a policy: on a GPU q|k|v, gate|up joined
    kinds = FusedRMSNorm | FusedRotaryAttention | FusedGatedMLP
    fused = [(m, type(m)) for m in model.modules() if isinstance(m, kinds)]
    prompts = arithmetic_prompt_ids(tok, args.batch_size, problems=args.problems)
    cuda = args.device.startswith("cuda")
    chosen = args.modes or ["growing", "static", *(["graphs"] if cuda else [])]
    if "graphs" in chosen and not cuda:
        ap.error("--modes graphs needs --device cuda (CUDA graphs)")
    for mode in ("graphs-sdpa", "graphs-unfused", "graphs-model", "graphs-efficient", "graphs-math"):
        if mode in chosen and not cuda:
            ap.error(f"--modes {mode} needs --device cuda (CUDA graphs)")
    modes = {MODES[name][0]: MODES[name][1] for name in chosen}
    attentions = {MODES[name][0]: ATTENTION.get(name, model.config._attn_implementation) for name in chosen}
    greedy, uncaptured = TemperatureExplorer(temperature=0.0), Uncaptured(temperature=0.0)

    engines = {
        name: HFEngine(model, tok, max_new_tokens=args.new_tokens, ignore_eos=True, backend=backend, **kwargs)
        for name, kwargs in modes.items()
    }

    def run(name):
        engine = engines[name]
        if model.config._attn_implementation != attentions[name]:
            model.set_attn_implementation(attentions[name])
        for module, cls in fused:  # a graph replays what was recorded; the class matters to record and eager steps
            module.__class__ = original_class(module) if name in UNFUSED else cls
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with sdpa_kernel(KERNEL[name]) if name in KERNEL else contextlib.nullcontext():
            batch = engine.generate(prompts, uncaptured if name in MODEL_STEP_ONLY else greedy)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0, batch

    first, failed = {}, {}
    for name in list(engines):  # warm-up (and graph recording); a mode that fails is reported
        try:
            first[name] = run(name)
        except Exception as err:  # noqa: BLE001 - the other modes still measure
            failed[name] = f"{type(err).__name__}: {err}"[:300]
            print(f"{name}: {failed[name]}", flush=True)
            del engines[name]
    best = {name: (float("inf"), None) for name in engines}
    for _ in range(args.repeats):
        for name in engines:
            seconds, batch = run(name)
            if seconds < best[name][0]:
                best[name] = (seconds, batch)
    width = max(len(p) for p in prompts)
    floor = floor_ms(model, args.batch_size, width, args.new_tokens, args.bandwidth_gbs) if args.bandwidth_gbs else None
    rows = []
    reference = best[next(iter(best))][1] if best else None
    for name, (seconds, batch) in best.items():
        step_ms = 1e3 * seconds / args.new_tokens
        rows.append(
            {
                "mode": name,
                "rollout_s": seconds,
                "first_run_s": first[name][0],
                "graph_warmup_s": first[name][1].stats.get("rollout/graph_warmup_s", 0.0),
                "rerecorded_s": batch.stats.get("rollout/graph_warmup_s", 0.0),
                "ms_per_step": step_ms,
                "floor_ms": floor,
                "x_floor": step_ms / floor if floor else None,
                "same_tokens": bool(torch.equal(batch.response_ids, reference.response_ids)),
                "max_logprob_diff": float((batch.rollout_logprobs - reference.rollout_logprobs).abs().max()),
            }
        )
    rows += [{"mode": name, "error": reason} for name, reason in failed.items()]
    print(f"{args.model} on {args.device} ({args.dtype}), {args.batch_size} rows x {args.new_tokens} tokens")
    print_table(rows, list(dict.fromkeys(key for row in rows for key in row)))  # every row's columns, in order
    write_json("decoding_modes", rows, args.out, model=args.model, device=args.device, dtype=args.dtype)


if __name__ == "__main__":
    main()
