"""What one training forward and backward asks of the device, counted, not timed: operations
dispatched, kernels among them (views and allocations left out), casts, matrix products, and the
tensors autograd keeps. Full fine-tuning against LoRA, the lean LoRA layers against peft's own, and both with the CUDA
backend's modules (``on a GPU``: fused norms and rotation, q|k|v and gate|up as one product
each way on weights joined in place; a GPU's own kernels, such as LoRA's float32 gradients
written by their products, do not show on a CPU).
The pass runs as the module's update runs it: inside ``recomputing()``, the backend's recomputing
modules' outputs recomputed in backward, not kept (counted so since 2026-11-27; before, their
recomputation was left out: 7,639 operations and 2,254 MiB kept for full fine-tuning, now 8,546
and 1,237).

The first pass after an optimizer step casts the adapters of a half model (and builds the
stacked copies of grouped LoRA layers); the passes after it, the other micro-batches of the step,
do not: ``kernels, a later pass`` counts one of those.

A GPU step of a small model is launch-bound: its update time follows the number of operations
(on one H100 the packaged model's update took 0.24 s for full fine-tuning and 0.54 s for LoRA,
about 28 and 36 us per operation counted here), so this count, the same on every machine,
explains a GPU figure measured elsewhere and checks a change meant to lower it, on any CPU.

    python benchmarks/update_ops.py                       # packaged model, bfloat16, 32 x 64 tokens
    python benchmarks/update_ops.py --dtype float32 --rows 8
    python benchmarks/update_ops.py --model tiny --rows 4 --tokens 16   # seconds: the counts per layer

The counts do not depend on the batch (the kept MiB do). Ten passes of the packaged model run in
all: on a CPU without native bfloat16 products (AVX2 only) the default took over 15 minutes, so
take fewer rows or tokens there.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, print_table, write_json  # noqa: E402

from ngrpo_lightning.backends import recompute  # noqa: E402
from ngrpo_lightning.backends.base import Backend  # noqa: E402
from ngrpo_lightning.backends.cuda import CUDABackend  # noqa: E402
from ngrpo_lightning.backends.swap import original_class  # noqa: E402
from ngrpo_lightning.models import lora  # noqa: E402
from ngrpo_lightning.models.loading import load_policy  # noqa: E402

NOT_KERNELS = {  # views and allocations: dispatched, but no kernel runs
    *("t", "view", "_unsafe_view", "detach", "slice", "expand", "transpose", "unsqueeze", "squeeze"),
    *("as_strided", "alias", "permute", "reshape", "select", "split", "split_with_sizes"),
    *("_reshape_alias", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"),
    *("flatten", "unflatten", "view_as", "unbind", "chunk", "narrow", "diagonal"),
}


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func.overloadpacket).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


class KeepingActivations(CUDABackend):
    """The CUDA backend's choices on a GPU that keeps the MLPs' activations (as at the packaged and
    1.5B shapes on an 80 GB GPU): a CPU has no GPU memory to weigh them against."""

    def recomputes(self, model: torch.nn.Module) -> bool:
        return False


def measure(args, mode: str) -> dict:
    model, _ = load_policy(args.model, dtype=args.dtype)
    if not mode.startswith("full"):
        settings = lora.LoraSettings(enabled=True, rank=args.rank, alpha=2 * args.rank, target_modules="all-linear")
        model = lora.apply(model, settings)
    if mode.endswith("on a GPU"):  # the CUDA backend's modules, as on a GPU that keeps the activations
        backend = KeepingActivations(dtype=model.dtype)
        backend.on_device(backend.prepare(model, trains=True))
    else:
        Backend(dtype=model.dtype).prepare(model, trains=True)
    if mode == "LoRA, peft's layers":
        for m in model.modules():
            if type(m) is not original_class(m) and type(m).__name__.startswith("Lean"):
                m.__class__ = original_class(m)
    model.train()
    ids = torch.randint(
        0, model.config.vocab_size, (args.rows, args.tokens), generator=torch.Generator().manual_seed(0)
    )
    kept = []

    def keep(t):  # what autograd keeps for backward; the recomputing modules' outputs are recomputed instead
        packed = recompute._pack(t)
        if packed is t:
            kept.append(t.numel() * t.element_size())
        return packed

    def a_pass():
        with Ops() as ops:
            with recompute.recomputing(pack=keep):  # as the module's update runs the pass
                logits = model(input_ids=ids).logits
            logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        return ops.count

    c = a_pass()
    later = a_pass()  # the adapters' casts are kept from the first pass until they change
    del kept[len(kept) // 2 :]
    return {
        "training": mode,
        "trained dtype": str(next(p.dtype for p in model.parameters() if p.requires_grad)).removeprefix("torch."),
        "operations": sum(c.values()),
        "kernels": sum(v for k, v in c.items() if k not in NOT_KERNELS),
        "kernels, a later pass": sum(v for k, v in later.items() if k not in NOT_KERNELS),
        "casts": c["_to_copy"],
        "products": c["mm"] + c["addmm"] + c["bmm"],
        "kept MiB": round(sum(kept) / 2**20, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", default=str(RESULTS / "update_ops.json"))
    args = ap.parse_args()
    modes = ("full", "LoRA", "LoRA, peft's layers", "full, on a GPU", "LoRA, on a GPU")
    rows = [measure(args, mode) for mode in modes]
    for row in rows:
        row["x full's operations"] = round(row["operations"] / rows[0]["operations"], 2)
    print(f"{args.model} ({args.dtype}), one forward and backward of {args.rows} x {args.tokens} tokens")
    print_table(rows, list(rows[0]))
    write_json("update_ops", rows, args.out, model=args.model, dtype=args.dtype, batch=[args.rows, args.tokens])


if __name__ == "__main__":
    main()
