"""Peak memory and time of one training update at paper-scale response lengths.

One update is what a training step does per micro-batch: the log-probs forward
(:func:`ngrpo_lightning.training.forward.response_logprobs`, entropy included), a GRPO loss and
backward (the optimizer step, the same for both paths, is left out). The model is
Qwen2-shaped and randomly initialised, with Qwen2's vocabulary of 151,936 tokens and a small
hidden size, so that the LM head's logits, not the decoder, dominate memory as they do for a
1.5B policy at long lengths. Two rows of a short prompt and L response tokens (a few
mixed-step records among them).

"before" is the full-logits path (``chunk_size=None``), "after" the chunked default.

Memory. Every configuration runs in a fresh subprocess. The *floor* is the process's memory
after building the model and its optimizer state: weights, gradients (kept allocated between
updates) and AdamW's two moments. Then the peak is reset and two updates run (a warm-up and a
timed one); the *peak* is the highest memory during them. On CPU both are resident set sizes
(``VmRSS`` and ``VmHWM`` of ``/proc/self/status``, the peak reset through ``clear_refs``;
``ru_maxrss`` where that is unavailable), on CUDA the allocator's allocated bytes. A "before"
configuration whose full logits (about six float32 [rows, L, V] tensors with the entropy, as
measured) would push the process past ``--limit-gib`` is skipped, with the reason printed.
``--chunks`` lists several chunk sizes for the "after" path (to choose the default).

    .venv/bin/python benchmarks/train_step_memory.py                          # L = 512, 2,048, 8,192 on CPU
    .venv/bin/python benchmarks/train_step_memory.py --lengths 2048 --device cuda --dtype bfloat16 --hidden 1536
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, peak_rss_bytes, print_table, reset_peak, rss_bytes, write_json  # noqa: E402

GIB = 1024**3
VOCAB = 151_936


# ------------------------------------------------------------------ child: one configuration
def build(args, device: torch.device, dtype: torch.dtype):
    """A random Qwen2-shaped model, its AdamW state and gradients allocated, and a rollout batch."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ngrpo_lightning.rollout import InputRecords, RolloutBatch

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.length + 8,
        tie_word_embeddings=args.tied,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for p in model.parameters():  # allocate gradients and AdamW's moments: the floor holds them
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)

    g = torch.Generator().manual_seed(0)
    n, length = args.rows, args.length
    m = max(1, length // 100)  # about 1% mixed steps
    records = InputRecords(
        row=torch.randint(0, n, (m,), generator=g),
        pos=torch.randint(0, length, (m,), generator=g),
        ids=torch.randint(0, args.vocab, (m, 3), generator=g),
        weights=torch.rand(m, 3, generator=g).softmax(-1),
        noise_seed=torch.full((m,), -1),
        noise_scale=torch.zeros(m),
    )
    batch = RolloutBatch(
        prompt_ids=torch.randint(0, args.vocab, (n, args.prompt), generator=g),
        prompt_mask=torch.ones(n, args.prompt, dtype=torch.long),
        response_ids=torch.randint(0, args.vocab, (n, length), generator=g),
        response_mask=torch.ones(n, length, dtype=torch.long),
        rollout_logprobs=-torch.rand(n, length, generator=g) * 5,
        records=records,
        group_size=n,
    )
    return model, optimizer, batch.to(device)


def update(model, batch, chunk_size) -> float:
    """One update (gradients accumulate into the kept buffers); returns its loss."""
    from ngrpo_lightning.objectives.grpo import grpo_loss
    from ngrpo_lightning.training.forward import response_logprobs

    logp, entropy = response_logprobs(model, batch, 1.0, with_entropy=True, chunk_size=chunk_size)
    advantages = torch.linspace(-1.0, 1.0, len(batch), device=logp.device)
    loss, _ = grpo_loss(logp, batch.rollout_logprobs, None, advantages, batch.response_mask, kl_coef=0.0)
    loss.backward()
    return loss.detach().item()


def child(args) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    chunk = None if args.path == "before" else args.chunk
    model, optimizer, batch = build(args, device, dtype)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        floor = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        floor = rss_bytes()
        was_reset = reset_peak()
    update(model, batch, chunk)  # warm-up: lazy allocations, first-call costs
    optimizer.zero_grad(set_to_none=False)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    update(model, batch, chunk)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes(was_reset)
    params = sum(p.numel() for p in model.parameters())
    return {
        "L": args.length,
        "path": args.path,
        "chunk": chunk,
        "params_M": params / 1e6,
        "floor_gib": floor / GIB,
        "peak_gib": peak / GIB,
        "above_floor_gib": (peak - floor) / GIB,
        "update_s": seconds,
    }


# ------------------------------------------------------------------ parent: the table
FULL_LOGITS_COPIES = 6  # float32 [rows, L, V] tensors alive at the full path's peak (measured: 6.1 at L = 2,048)


def full_logits_gib(args, length: int) -> float:
    """What the full-logits path adds above the floor, roughly."""
    return FULL_LOGITS_COPIES * args.rows * (length + 1) * args.vocab * 4 / GIB


def run_child(args, length: int, path: str, chunk: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--path", path, "--length", str(length), "--chunk", str(chunk)]
    for key in ("device", "dtype", "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "rows", "prompt"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    cmd += ["--tied"] if args.tied else []
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} L={length} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from ngrpo_lightning.training.forward import DEFAULT_LOGPROB_CHUNK

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192], help="response lengths L")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=0, help="MLP width (0: 4 x hidden)")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--tied", action="store_true", help="tie the head to the input embeddings (Qwen2: untied)")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    ap.add_argument(
        "--chunks", type=int, nargs="+", default=[DEFAULT_LOGPROB_CHUNK], help="LM-head chunk sizes of the 'after' path"
    )
    ap.add_argument("--limit-gib", type=float, default=18.0, help="skip 'before' runs expected to exceed this")
    ap.add_argument("--paths", nargs="+", default=["before", "after"], choices=["before", "after"])
    ap.add_argument("--out", default=str(RESULTS / "train_step_memory.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="after", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, default=512, help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=DEFAULT_LOGPROB_CHUNK, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    rows = []
    runs = [(path, chunk) for path in args.paths for chunk in (args.chunks if path == "after" else [0])]
    for length in args.lengths:
        for path, chunk in runs:
            expected = full_logits_gib(args, length)
            if path == "before" and args.device == "cpu" and expected + 2.0 > args.limit_gib:
                print(
                    f"skipping before L={length}: its full logits need ~{expected:.1f} GiB ({FULL_LOGITS_COPIES} x "
                    f"{args.rows} x {length + 1} x {args.vocab} float32), over --limit-gib={args.limit_gib:g}"
                )
                rows.append({"L": length, "path": path, "skipped": f"~{expected:.1f} GiB of logits"})
                continue
            rows.append(run_child(args, length, path, chunk))
            print_table(rows[-1:], list(rows[-1]))
    for r in rows:  # the ratio of the peak above the floor, before / after, at each length
        before = next((b for b in rows if b["L"] == r["L"] and b["path"] == "before" and "peak_gib" in b), None)
        if r["path"] == "after" and before is not None:
            r["before_over_after"] = before["above_floor_gib"] / max(r["above_floor_gib"], 1e-9)
    columns = [
        "L",
        "path",
        "chunk",
        "floor_gib",
        "peak_gib",
        "above_floor_gib",
        "before_over_after",
        "update_s",
        "skipped",
    ]
    print()
    print_table(rows, columns)
    write_json(
        "train_step_memory",
        rows,
        path=args.out,
        device=args.device,
        dtype=args.dtype,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        rows_per_batch=args.rows,
        prompt=args.prompt,
        tied=args.tied,
        chunks=args.chunks,
    )


if __name__ == "__main__":
    main()
