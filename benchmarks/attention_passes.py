"""Attention of a log-prob or training pass: PyTorch's kernel against ``sdpa_gqa``'s matmuls.

One layer's attention, forward and backward, at the shapes of the side-by-side workload's
passes and a few longer ones (grouped heads as on the packaged model: 9 query heads, 3 key/value
heads, 64 wide; transformers' padded causal mask, the queries at the last positions). Three
ways: PyTorch's masked kernel, ``sdpa_gqa`` as it dispatches (``uses``: the matmuls of
``HalfPrecisionAttention`` for short half-precision passes, the causal kernel on shifted rows
for long ones, the masked kernel otherwise), and the matmuls forced at every shape. Each is
timed in turn within a repeat, so that load drifts hit all three alike; the median over repeats
is reported. Also each one's largest error against float64 on the same inputs.

    python benchmarks/attention_passes.py                      # bfloat16 and float32
    python benchmarks/attention_passes.py --dtypes bfloat16 --repeats 5

Prints a table and writes JSON to benchmarks/results/ (git-ignored).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json  # noqa: E402

from ngrpo_lightning.backends import attention  # noqa: E402

# (rows, queries, keys): the workload's responses after their shared prompt, its prompts, longer passes
SHAPES = [(32, 40, 106), (4, 66, 66), (32, 64, 130), (8, 128, 212), (8, 256, 340), (4, 512, 600), (4, 1024, 1104)]
HEADS, KV_HEADS, DIM = 9, 3, 64


def inputs(rows: int, queries: int, keys: int, seed: int = 0):
    """float64 q, k, v and the boolean mask [rows, 1, queries, keys]: a causal pass whose rows
    start at different keys (left padding)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, HEADS, queries, DIM, generator=g, dtype=torch.float64)
    k, v = (torch.randn(rows, KV_HEADS, keys, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    position = torch.arange(keys)
    starts = torch.randint(0, max(1, keys - queries), (rows,), generator=g)
    starts[0] = 0
    causal = position[None] <= position[keys - queries :, None]
    mask = causal[None] & (position[None] >= starts[:, None])[:, None]
    return q, k, v, mask[:, None]


def kernel(q, k, v, mask):
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)


def dispatched(q, k, v, mask):
    module = type("Layer", (), {"training": True})()
    return attention.sdpa_gqa_attention_forward(module, q, k, v, mask)[0]


def matmuls(q, k, v, mask):
    return attention.grouped_attention(q, k, v, mask)


def forward_backward_ms(fn, q, k, v, mask, grad) -> float:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    start = time.perf_counter()
    torch.autograd.grad(fn(q, k, v, mask), (q, k, v), grad)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/attention_passes.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ways = {"kernel": kernel, "sdpa_gqa": dispatched, "matmuls": matmuls}
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for shape in SHAPES:
            q64, k64, v64, mask = inputs(*shape)
            grad64 = torch.randn(shape[0], shape[1], HEADS, DIM, dtype=torch.float64)
            exact = kernel(q64, k64, v64, mask)
            q, k, v, grad = (t.to(dtype) for t in (q64, k64, v64, grad64))
            times = {name: [] for name in ways}
            for _ in range(args.repeats + 1):  # the first round warms up
                for name, fn in ways.items():
                    times[name].append(forward_backward_ms(fn, q, k, v, mask, grad))
            row = {"dtype": dtype_name, "rows x queries x keys": " x ".join(map(str, shape))}
            if attention.half_precision_products_pay(q, k):
                row["uses"] = "matmuls"
            else:
                row["uses"] = "causal kernel" if attention.causal_starts(mask, shape[1]) is not None else "kernel"
            for name, fn in ways.items():
                row[f"{name}_ms"] = statistics.median(times[name][1:])
                with torch.no_grad():
                    row[f"{name}_err"] = float((fn(q, k, v, mask).double() - exact).abs().max())
            row["kernel / sdpa_gqa"] = row["kernel_ms"] / row["sdpa_gqa_ms"]
            rows.append(row)
            print(
                f"{dtype_name} {row['rows x queries x keys']}: kernel {row['kernel_ms']:.1f} ms, "
                f"sdpa_gqa {row['sdpa_gqa_ms']:.1f} ms ({row['uses']})",
                flush=True,
            )
    print()
    columns = ["dtype", "rows x queries x keys", "uses", "kernel_ms", "sdpa_gqa_ms", "matmuls_ms", "kernel / sdpa_gqa"]
    print_table(rows, columns + ["kernel_err", "matmuls_err"])
    write_json("attention_passes", rows, args.out, heads=HEADS, kv_heads=KV_HEADS, dim=DIM, repeats=args.repeats)


if __name__ == "__main__":
    main()
