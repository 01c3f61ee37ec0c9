"""HFEngine vs ``model.generate``: decode throughput on the packaged model.

Both decode greedily for exactly ``--new-tokens`` tokens per row (EOS suppressed), from the
same left-padded chat prompts of the built-in task, so they do the same work.

    .venv/bin/python benchmarks/rollout_throughput.py                      # batch 8 and 32, 128 tokens, fp32 and bf16
    .venv/bin/python benchmarks/rollout_throughput.py --batch-sizes 8 --dtypes float32 --repeats 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import arithmetic_prompt_ids, best_of, print_table, write_json  # noqa: E402

from ngrpo_lightning.explorers import TemperatureExplorer  # noqa: E402
from ngrpo_lightning.models import load_policy  # noqa: E402
from ngrpo_lightning.rollout import HFEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per case (after one warm-up); the best counts")
    args = ap.parse_args()

    rows = []
    for dtype in args.dtypes:
        model, tok = load_policy(args.model, dtype=dtype)
        model.eval()
        for batch in args.batch_sizes:
            prompts = arithmetic_prompt_ids(tok, batch)
            engine = HFEngine(model, tok, max_new_tokens=args.new_tokens)
            engine.eos_ids = []  # decode exactly new_tokens per row, like generate below
            greedy = TemperatureExplorer(temperature=0.0)
            t_engine, out = best_of(lambda: engine.generate(prompts, greedy), args.repeats)
            tok.padding_side = "left"
            enc = tok.pad({"input_ids": prompts}, return_tensors="pt")

            def generate():
                with torch.inference_mode():
                    return model.generate(**enc, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)

            t_gen, _ = best_of(generate, args.repeats)
            tokens = batch * args.new_tokens
            assert int(out.response_mask.sum()) == tokens
            rows.append({"dtype": dtype, "batch": batch, "new_tokens": args.new_tokens,
                         "hf_engine_tok_s": tokens / t_engine, "generate_tok_s": tokens / t_gen, "speedup": t_gen / t_engine})
            print_table(rows[-1:], list(rows[-1]))
    print()
    print_table(rows, list(rows[0]))
    write_json("rollout_throughput", rows, model=args.model, repeats=args.repeats)


if __name__ == "__main__":
    main()
