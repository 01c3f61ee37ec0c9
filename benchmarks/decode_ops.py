"""What one decoding step asks of the device, counted, not timed: the operations a step of the
model dispatches and the kernels among them (views and allocations left out), the matrix
products, and the sums, per decoder layer, with the CUDA backend's modules (fused norms,
rotation and residual sums, q|k|v and gate|up as one product each on weights joined in place:
``backends/fused.py``, ``backends/joined.py``) against transformers' own.

A decoding step replayed from a CUDA graph costs about 2 us per kernel however little it does
(docs/performance.md), so at a small model's shape its time follows this count, the same on every
machine: a change meant to lower it is checked here, on any CPU. It counts PyTorch's operations,
not the CUDA kernels inside one (CUDA's ``roll`` copies a strided input first: one operation, two
kernels there).

Counted on the CPU with the CUDA backend's classes (attention as the CPU computes it: the same in
both rows), greedy decoding on the static cache, eagerly:
one rollout of ``--tokens`` tokens and one of twice as many, the difference over the extra steps
(the prefill and the rollout's setup cancel out), the explorer and the engine's bookkeeping left
out (``benchmarks/host_syncs.py`` counts those).

    python benchmarks/decode_ops.py                    # packaged model's structure, bfloat16
    python benchmarks/decode_ops.py --model tiny
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, arithmetic_prompt_ids, print_table, write_json  # noqa: E402
from update_ops import NOT_KERNELS  # noqa: E402

from ngrpo_lightning.backends.cuda import CUDABackend  # noqa: E402
from ngrpo_lightning.backends.swap import original_class  # noqa: E402
from ngrpo_lightning.explorers import TemperatureExplorer  # noqa: E402
from ngrpo_lightning.models.loading import load_policy  # noqa: E402
from ngrpo_lightning.rollout import HFEngine  # noqa: E402

PRODUCTS = {"mm", "addmm", "bmm", "linear", "matmul", "baddbmm"}


class ModelOps(TorchDispatchMode):
    """Operations dispatched inside ``model``'s forward (its pre-hook to its hook), by name."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model, self.count, self.inside = model, Counter(), 0

    def __enter__(self):
        self.hooks = [
            self.model.register_forward_pre_hook(lambda *args: setattr(self, "inside", self.inside + 1)),
            self.model.register_forward_hook(lambda *args: setattr(self, "inside", self.inside - 1)),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside:
            self.count[str(func.overloadpacket).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


def per_step(model, tok, prompts, tokens: int, backend) -> Counter:
    """Operations per decoding step: two rollouts' difference over their extra steps."""
    counts = []
    for length in (tokens, 2 * tokens):
        engine = HFEngine(
            model, tok, max_new_tokens=length, seed=0, ignore_eos=True, backend=backend, static_cache=True, graphs=False
        )
        with ModelOps(model) as ops:
            engine.generate(prompts, TemperatureExplorer(temperature=0.0))
        counts.append(ops.count)
    diff = Counter(counts[1])
    diff.subtract(counts[0])
    return Counter({k: v / tokens for k, v in diff.items() if v})


def row(label: str, ops: Counter, layers: int) -> dict:
    kernels = sum(v for k, v in ops.items() if k not in NOT_KERNELS)
    return {
        "modules": label,
        "operations": round(sum(ops.values()), 1),
        "kernels": round(kernels, 1),
        "kernels per layer": round(kernels / layers, 2),
        "products": round(sum(ops[k] for k in PRODUCTS), 1),
        "sums": round(ops["add"] + ops["add_"], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--out", default=str(RESULTS / "decode_ops.json"))
    args = ap.parse_args()
    backend = CUDABackend(getattr(torch, args.dtype))
    model, tok = load_policy(args.model, dtype=args.dtype, attn_implementation=backend.attention)
    prompts = arithmetic_prompt_ids(tok, args.rows)
    layers = model.config.num_hidden_layers
    backend.on_device(backend.prepare(model, trains=True)).eval()
    rows = [row("the CUDA backend's", per_step(model, tok, prompts, args.tokens, backend), layers)]
    for m in model.modules():  # transformers' own classes (the joined weights stay: they compute the same)
        m.__class__ = original_class(m)
    rows.append(row("transformers' own", per_step(model, tok, prompts, args.tokens, backend), layers))
    print(f"{args.model} ({args.dtype}), one decoding step of {args.rows} rows, counted on the CPU")
    print_table(rows, list(rows[0]))
    write_json("decode_ops", rows, args.out, model=args.model, dtype=args.dtype, batch=args.rows)


if __name__ == "__main__":
    main()
