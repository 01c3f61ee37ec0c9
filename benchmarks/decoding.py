"""``harness.py decoding``: HFEngine's decoding modes side by side, against the bandwidth floor.

Modes: the growing KV cache (``growing``); the static cache (``static``); the static cache with
each step replayed from a CUDA graph recorded as it runs (``graphs``, whole steps: the model, the
explorer and the bookkeeping; ``graphs-model``, the model's step alone, as for an explorer that does
not declare capturable) or compiled by ``torch.compile`` (``compile``). Variants of ``graphs``:
``graphs-sdpa`` with transformers' own ``sdpa`` (given a mask, it copies each grouped key and value
head per query head) instead of the backend's stacked heads; ``graphs-efficient`` and
``graphs-math`` with PyTorch's memory-efficient attention kernel or its matmuls instead of the
kernel it picks itself; ``graphs-unfused`` (and ``static-unfused``, its eager step) with
transformers' own norms, attention and MLPs in place of the CUDA backend's fused ones.

Every mode decodes the same prompts greedily for exactly ``--new-tokens`` tokens per row (EOS
suppressed), fastest of ``--repeats`` runs, interleaved, each mode on one engine all along (it
keeps its static cache and graphs, as in training); the first run of each mode (and its graph
recording) is a warm-up, reported apart. Tokens are compared with the first mode's, log-probs
agree up to float rounding. A step's floor is the bytes it must read (every weight once, each
row's keys and values so far) over ``--bandwidth-gbs``. A mode that fails (its graphs cannot be
recorded, say) is reported with its error; the others still run.
"""

from __future__ import annotations

import contextlib
import time

import torch
from common import arithmetic_prompt_ids, print_table, write_record
from torch.nn.attention import SDPBackend, sdpa_kernel

from ngrpo_lightning.backends import backend_for
from ngrpo_lightning.backends.fused import FusedGatedMLP, FusedRMSNorm, FusedRotaryAttention
from ngrpo_lightning.backends.swap import original_class
from ngrpo_lightning.explorers import TemperatureExplorer
from ngrpo_lightning.models.loading import load_policy
from ngrpo_lightning.rollout import HFEngine

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
    # the decoding step's attention kernel chosen by hand (torch.nn.attention.sdpa_kernel)
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


def run(args) -> None:
    cuda = args.device.startswith("cuda")
    chosen = args.modes or ["growing", "static", *(["graphs"] if cuda else [])]
    if set(chosen) - set(MODES):
        raise SystemExit(f"decoding: unknown modes {sorted(set(chosen) - set(MODES))}; known: {', '.join(MODES)}")
    needs_cuda = [m for m in chosen if m.startswith("graphs")]
    if needs_cuda and not cuda:
        raise SystemExit(f"decoding: --modes {' '.join(needs_cuda)} need --device cuda (CUDA graphs)")
    model, tok = load_policy(args.model, dtype=args.dtype)
    model = model.to(args.device)
    # the backend's speed-ups as --enable names them; torch.compile cannot trace the CPU's packed products
    off = ("packed_products",) if "compile" in chosen and not cuda else ()
    backend = type(backend_for(model))(model.dtype, enable=tuple(args.enable), disable=off)
    backend.on_device(backend.prepare(model, trains=True))  # as a policy: on a GPU q|k|v, gate|up joined
    kinds = FusedRMSNorm | FusedRotaryAttention | FusedGatedMLP
    fused = [(m, type(m)) for m in model.modules() if isinstance(m, kinds)]
    prompts = arithmetic_prompt_ids(tok, args.batch_size, problems=args.problems)
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
    print_table(rows)
    workload = f"{args.model}, {args.dtype}, {args.batch_size} rows x {args.new_tokens} tokens, greedy, EOS ignored"
    device = "cuda" if cuda else "cpu"
    write_record("decoding", device, workload, "ms_per_step", True, args.out, rows=rows,
                 bandwidth_gbs=args.bandwidth_gbs)  # fmt: skip
