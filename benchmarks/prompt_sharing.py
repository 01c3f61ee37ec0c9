"""A group's prompt run once or per row, timed: the log-prob pass without gradients (the KL
reference's) and with its backward (the update's), for a whole step's rows and for a micro-batch
of one group, beside what the run's backend decides (``Backend.shares_prompts``).

Sharing runs the decoder twice, the distinct prompts and then the responses, to leave out the
prompt tokens of every sample but one per group. On a CPU a pass costs its arithmetic, and sharing
always pays. On a GPU a small model's pass waits on kernel launches, which sharing doubles; the
CUDA backend shares where the arithmetic it leaves out outweighs a second pass's launches (see
``CUDABackend``). This script checks that rule where it matters: on the GPU, at each model shape,
which way is faster. The prompts are the built-in task's (or a problems file's), chat-templated,
their ids taken modulo the model's vocabulary; the responses are random tokens of a fixed length.

    python benchmarks/prompt_sharing.py --model /tmp/large-shapes/qwen2.5-1.5b-bfloat16 --device cuda
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, arithmetic_prompt_ids, best_of, print_table, write_json  # noqa: E402

from ngrpo_lightning.backends import select_backend  # noqa: E402
from ngrpo_lightning.models.loading import load_policy, resolve_model_path  # noqa: E402
from ngrpo_lightning.rollout import InputRecords, RolloutBatch  # noqa: E402
from ngrpo_lightning.training.forward import response_logprobs  # noqa: E402
from ngrpo_lightning.training.logprob_passes import layer_params, shared_prompt_tokens  # noqa: E402


def step_batch(tok, vocab: int, prompts: int, group: int, tokens: int, device, problems: str) -> RolloutBatch:
    """``prompts`` x ``group`` rows: chat-templated prompts (left padded) and random responses."""
    ids = [[i % vocab for i in p] for p in arithmetic_prompt_ids(tok, prompts, problems=problems)]
    width = max(map(len, ids))
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in ids]).repeat_interleave(group, 0)
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids]).repeat_interleave(group, 0)
    n = prompts * group
    response_ids = torch.randint(0, vocab, (n, tokens), generator=torch.Generator().manual_seed(0))
    batch = RolloutBatch(
        prompt_ids, prompt_mask, response_ids, torch.ones(n, tokens, dtype=torch.long), torch.zeros(n, tokens),
        InputRecords(), group_size=group,
    )  # fmt: skip
    return batch.to(device)


def synced(fn, device):
    """``fn`` and then a wait for its kernels: on a GPU a pass's time is its kernels', not their queueing."""

    def call():
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return call


def measure(path: str, args) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model, tok = load_policy(path, dtype=args.dtype, attn_implementation="sdpa")
    model.to(device)
    backend = select_backend("auto", dtype, accelerator="gpu" if device.type == "cuda" else "cpu")
    batch = step_batch(tok, model.config.vocab_size, args.prompts, args.group, args.tokens, device, args.problems)
    params = layer_params(model)
    rows = []
    for what, sub in (
        ("the step's rows", batch),
        ("a micro-batch of one group", batch.select(torch.arange(args.group))),
    ):
        saved = shared_prompt_tokens(sub)
        row = {"model": Path(path).name, "rows": len(sub), "prompt width": sub.prompt_ids.shape[1], "what": what}
        for share in (False, True):

            def no_grad(share=share):
                with torch.no_grad():
                    response_logprobs(model, sub, 1.0, share_prompts=share)

            def with_backward(share=share):
                logp, _ = response_logprobs(model, sub, 1.0, share_prompts=share)
                logp.sum().backward()
                model.zero_grad(set_to_none=True)

            tag = "shared" if share else "per row"
            row[f"reference ms, {tag}"] = 1e3 * best_of(synced(no_grad, device), args.repeats)[0]
            row[f"update ms, {tag}"] = 1e3 * best_of(synced(with_backward, device), args.repeats)[0]
        row["saved tokens"], row["layer params, M"] = saved, round(params / 1e6, 1)  # the rule's inputs
        row["backend shares"] = backend.shares_prompts(saved, params)
        faster = row["update ms, shared"] < row["update ms, per row"]
        row["right"] = row["backend shares"] == faster
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2-135m-instruct"], help="model folders or names")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=40, help="response tokens per row")
    ap.add_argument("--problems", default="", help="a problems file, where reasoning-gym is not installed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "prompt_sharing.json"))
    args = ap.parse_args()
    rows = [row for path in args.model for row in measure(resolve_model_path(path), args)]
    for row in rows:
        for key, value in row.items():
            if key.endswith(" ms, shared") or key.endswith(" ms, per row"):
                row[key] = round(value, 1)
    print(f"{args.device}, {args.dtype}, {args.tokens}-token responses, fastest of {args.repeats}")
    columns = list(rows[0])
    print_table(rows, columns)
    write_json("prompt_sharing", rows, args.out, device=args.device, dtype=args.dtype, tokens=args.tokens)


if __name__ == "__main__":
    main()
