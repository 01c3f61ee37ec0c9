"""What a new pass width costs: a training pass (the decoder's forward and backward, rows left
padded, as the framework's log-prob and training passes are) at a run of widths never seen before,
then at the same widths again, with transformers' ``sdpa`` and with the backend's ``sdpa_gqa``.

On a GPU, PyTorch's cuDNN attention builds a plan for every new shape it meets (batch, query and
key lengths), and a run's passes come at a new width almost every time: each pass is cut to its
own rows' longest sequence. ``sdpa_gqa`` computes such a pass's attention at one of a bounded set
of widths (``backends/width_buckets.py``: multiples of 64 up to 1,024, then 16 per doubling). The
first time through less the second is what the new shapes cost; each attention runs in a process
of its own, so neither finds the other's plans. The same widths in the same order both ways.

On the CPU both run (a dry run of the script: the CPU plans nothing per shape, and ``sdpa_gqa``
pads nothing there).

    python benchmarks/attention_shapes.py                                  # the packaged model
    python benchmarks/attention_shapes.py --model /tmp/large-shapes/qwen2.5-1.5b-bfloat16 --widths 150:360

Prints a table and writes JSON to benchmarks/results/ (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, print_table, write_json  # noqa: E402

from ngrpo_lightning.backends.width_buckets import bucket_width  # noqa: E402


def widths_of(spec: str, calls: int, seed: int) -> list[int]:
    """``calls`` different widths from ``lo:hi``, in a seeded order."""
    lo, hi = (int(x) for x in spec.split(":"))
    if hi - lo + 1 < calls:
        raise SystemExit(f"--widths {spec} holds fewer than --calls {calls} widths")
    return random.Random(seed).sample(range(lo, hi + 1), calls)


def one_attention(args) -> dict:
    """Time the passes with ``args.one``'s attention in this process; returns its row."""
    from ngrpo_lightning.models.loading import load_policy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = load_policy(args.model, dtype=args.dtype, device=device, attn_implementation=args.one)
    decoder, vocab = model.get_decoder(), model.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def one_pass(width: int) -> float:
        ids = torch.randint(3, vocab, (args.rows, width), generator=g)
        mask = torch.ones_like(ids)
        for row in range(1, args.rows):  # left padding; the first row is the longest
            mask[row, : int(torch.randint(0, width // 4 + 1, (), generator=g))] = 0
        ids, mask = ids.to(device), mask.to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        hidden.float().square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    one_pass(16)  # the process's own first work (libraries, allocator), at a width not in the run
    widths = widths_of(args.widths, args.calls, args.seed)
    first = [one_pass(w) for w in widths]
    again = [one_pass(w) for w in widths]
    padded = device == "cuda" and args.one == "sdpa_gqa"
    shapes = len({bucket_width(w) if padded else w for w in widths})
    return {
        "attention": args.one,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "passes": len(widths),
        "attention widths": shapes,
        "first time s": round(sum(first), 3),
        "again s": round(sum(again), 3),
        "per new width s": round((sum(first) - sum(again)) / shapes, 4),
        "per pass, again, ms": round(1000 * sum(again) / len(again), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a packaged model's name or a model directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=8, help="rows per pass (a micro-batch)")
    ap.add_argument("--widths", default="100:200", help="lo:hi, the pass widths drawn from")
    ap.add_argument("--calls", type=int, default=16, help="passes, each at a width of its own")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attentions", nargs="+", default=["sdpa", "sdpa_gqa"])
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one attention, its row as JSON
    ap.add_argument("--out", default=str(RESULTS / "attention_shapes.json"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_attention(args)))
        return
    widths_of(args.widths, args.calls, args.seed)  # a bad range fails here, not in a child
    rows = []
    for name in args.attentions:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", name]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{name}: the child process failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{args.model} ({args.dtype}), {args.rows} rows, {args.calls} passes at widths {args.widths}, then again")
    print_table(rows, list(rows[0]))
    write_json("attention_shapes", rows, args.out, model=args.model, dtype=args.dtype, widths=args.widths)


if __name__ == "__main__":
    main()
