"""Rollout speed with LoRA adapters against full fine-tuning's, on HFEngine (CPU).

A LoRA policy's linear layers compute ``W x + (alpha / rank) B (A x)``. For a rollout,
HFEngine packs each adapted layer merged (``W + scale B A``, once per rollout), so decoding
multiplies once per layer and token as a plain model does. Three contenders decode the same
prompts greedily for exactly ``--new-tokens`` tokens per row (EOS suppressed): the plain
model (full fine-tuning's policy), the LoRA policy as HFEngine runs it (merged), and the LoRA
policy with its adapters unmerged (the base and the two adapter products packed one by one,
as before merging existed). Their fastest of ``--repeats`` timed runs are compared, run
interleaved so that a slow spell of the machine does not fall on one of them.

    .venv/bin/python benchmarks/lora_rollout.py
    .venv/bin/python benchmarks/lora_rollout.py --batch-sizes 32 --new-tokens 40 128 --rank 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, arithmetic_prompt_ids, best_of_each, print_table, write_json  # noqa: E402

from ngrpo_lightning.backends import backend_for  # noqa: E402
from ngrpo_lightning.backends.lora import LeanLoraLinear  # noqa: E402
from ngrpo_lightning.explorers import TemperatureExplorer  # noqa: E402
from ngrpo_lightning.models import lora  # noqa: E402
from ngrpo_lightning.models.loading import load_policy  # noqa: E402
from ngrpo_lightning.rollout import HFEngine  # noqa: E402


def lora_policy(name: str, rank: int) -> torch.nn.Module:
    """The packaged model with rank-``rank`` adapters on every linear layer, B drawn small
    (a trained adapter: the merged weights differ from the base)."""
    policy = lora.apply(load_policy(name)[0], lora.LoraSettings(enabled=True, rank=rank, alpha=2 * rank))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, param in policy.named_parameters():
            if "lora_B" in pname:
                param.copy_(torch.randn(param.shape, generator=gen) * 1e-3)
    return policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32])
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[40, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "lora_rollout.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    full, tok = load_policy(args.model)
    adapted = lora_policy(args.model, args.rank)
    backends = {id(m): backend_for(m) for m in (full, adapted)}
    for model in (full, adapted):  # the products the run's backend would choose
        backends[id(model)].prepare(model)
    greedy = TemperatureExplorer(temperature=0.0)

    def unmerged(engine, prompts):
        with mock.patch.object(LeanLoraLinear, "merge_adapter_name", lambda self: None):
            return engine.generate(prompts, greedy)

    rows = []
    for batch in args.batch_sizes:
        prompts = arithmetic_prompt_ids(tok, batch)
        for new in args.new_tokens:
            engines = {
                name: HFEngine(model, tok, max_new_tokens=new, ignore_eos=True, backend=backends[id(model)])
                for name, model in (("full", full), ("lora", adapted))
            }
            times, outs = best_of_each(
                {
                    "full": lambda: engines["full"].generate(prompts, greedy),
                    "lora_merged": lambda: engines["lora"].generate(prompts, greedy),
                    "lora_unmerged": lambda: unmerged(engines["lora"], prompts),
                },
                args.repeats,
            )
            tokens = batch * new
            assert all(int(out.response_mask.sum()) == tokens for out in outs.values())
            rows.append(
                {
                    "batch": batch,
                    "new_tokens": new,
                    "full_tok_s": tokens / times["full"],
                    "lora_merged_tok_s": tokens / times["lora_merged"],
                    "lora_unmerged_tok_s": tokens / times["lora_unmerged"],
                    "merged_vs_full": times["full"] / times["lora_merged"],
                    "unmerged_vs_full": times["full"] / times["lora_unmerged"],
                }
            )
            print_table(rows[-1:], list(rows[-1]))
    print()
    print_table(rows, list(rows[0]))
    path = write_json("lora_rollout", rows, args.out, model=args.model, rank=args.rank, repeats=args.repeats)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
