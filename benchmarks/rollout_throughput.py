"""HFEngine vs ``model.generate``: decode throughput on the packaged model.

Two workloads, same prompts, seeds and number of samples for both decoders:

* ``fixed``: greedy, exactly ``--new-tokens`` tokens per row (EOS suppressed), from chat
  prompts of the built-in task: both do the same work, so this measures the per-step cost.
* ``variable``: sampling at temperature 1 (no top-k / top-p), EOS on, at most
  ``--max-new-tokens``, from a mix of prompts asking for a one-word answer and prompts asking
  for a long explanation, so response lengths range from a few tokens to the limit, as in RL
  rollouts. ``generate`` keeps decoding every row until the longest ends; HFEngine drops rows
  as they end. Throughput counts useful tokens only (each row's response up to and including
  its EOS). ``hf_engine_kept_rows`` is HFEngine with ``drop_finished_rows=False`` (every row
  decodes until the longest ends, as ``generate`` does): the engine before rows could leave;
  ``--drop-min-frac 0.25 0.5`` adds HFEngine letting ended rows leave only in such shares.
  Samples differ between decoders (different random streams), so their useful token counts
  differ a little; each decoder repeats its own identical rollout (the same seed every repeat).

    .venv/bin/python benchmarks/rollout_throughput.py            # both workloads, batch 8 and 32, fp32 and bf16
    .venv/bin/python benchmarks/rollout_throughput.py --workloads variable --batch-sizes 8 --dtypes float32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, arithmetic_prompt_ids, best_of_each, print_table, write_json  # noqa: E402

from ngrpo_lightning.explorers import TemperatureExplorer  # noqa: E402
from ngrpo_lightning.models.loading import load_policy  # noqa: E402
from ngrpo_lightning.rollout import HFEngine  # noqa: E402

# The variable workload alternates these: answers of a few tokens, and answers past any limit.
SHORT_QUESTIONS = [
    "Answer with one word only: what colour is a clear daytime sky?",
    "Reply with just the number: how many legs does a spider have?",
    "Answer yes or no: is water wet?",
    "Name the capital of France. One word.",
]
LONG_QUESTIONS = [
    "Explain in detail how a bicycle works, part by part.",
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain step by step how to bake bread, with all the details.",
    "Describe the history of the printing press at length.",
]


def variable_prompt_ids(tokenizer, n: int) -> list[list[int]]:
    """``n`` chat prompts alternating short-answer and long-answer questions."""
    questions = [q for pair in zip(SHORT_QUESTIONS, LONG_QUESTIONS) for q in pair]
    chats = [[{"role": "user", "content": questions[i % len(questions)]}] for i in range(n)]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def useful_tokens(responses: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """Per row: tokens up to and including the first EOS (all of them if none)."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids))
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, responses.shape[1])
    return first


def run_fixed(model, tok, batch: int, args) -> dict:
    prompts = arithmetic_prompt_ids(tok, batch)
    engine = HFEngine(model, tok, max_new_tokens=args.new_tokens, ignore_eos=True)  # new_tokens per row, as generate
    greedy = TemperatureExplorer(temperature=0.0)
    tok.padding_side = "left"
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt")

    def generate():
        with torch.inference_mode():
            return model.generate(
                **enc, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
            )

    times, outs = best_of_each({"engine": lambda: engine.generate(prompts, greedy), "generate": generate}, args.repeats)
    t_engine, t_gen, out = times["engine"], times["generate"], outs["engine"]
    tokens = batch * args.new_tokens
    assert int(out.response_mask.sum()) == tokens
    return {
        "workload": "fixed",
        "batch": batch,
        "max_new": args.new_tokens,
        "engine_tokens": tokens,
        "generate_tokens": tokens,
        "hf_engine_tok_s": tokens / t_engine,
        "generate_tok_s": tokens / t_gen,
        "speedup": t_gen / t_engine,
    }


def run_variable(model, tok, batch: int, args) -> dict:
    prompts = variable_prompt_ids(tok, batch)
    sampler = TemperatureExplorer(temperature=1.0)

    def engine_run(drop: bool, frac: float = 0.0):
        engine = HFEngine(
            model, tok, max_new_tokens=args.max_new_tokens, seed=args.seed, drop_finished_rows=drop, drop_min_frac=frac
        )
        return engine.generate(prompts, sampler)

    tok.padding_side = "left"
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt")

    def generate():
        torch.manual_seed(args.seed)
        with torch.inference_mode():
            return model.generate(
                **enc, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0
            )

    contenders = {"engine": lambda: engine_run(True), "kept": lambda: engine_run(False), "generate": generate}
    fracs = [f for f in args.drop_min_frac if f > 0]
    contenders.update({f"deferred_{f}": (lambda f=f: engine_run(True, f)) for f in fracs})
    times, outs = best_of_each(contenders, args.repeats)
    t_engine, t_kept, t_gen = times["engine"], times["kept"], times["generate"]
    out, gen = outs["engine"], outs["generate"]
    eos = HFEngine(model, tok).eos_ids
    engine_tokens = int(out.response_mask.sum())
    gen_lengths = useful_tokens(gen[:, enc["input_ids"].shape[1] :], eos)
    gen_tokens = int(gen_lengths.sum())
    engine_rate, gen_rate = engine_tokens / t_engine, gen_tokens / t_gen
    lengths = out.response_lengths
    return {
        "workload": "variable",
        "batch": batch,
        "max_new": args.max_new_tokens,
        "engine_tokens": engine_tokens,
        "generate_tokens": gen_tokens,
        "engine_len_min_max": f"{int(lengths.min())}-{int(lengths.max())}",
        "hf_engine_tok_s": engine_rate,
        "hf_engine_kept_rows_tok_s": engine_tokens / t_kept,
        **{f"hf_engine_drop_min_frac_{f}_tok_s": engine_tokens / times[f"deferred_{f}"] for f in fracs},
        "generate_tok_s": gen_rate,
        "speedup": engine_rate / gen_rate,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workloads", nargs="+", default=["fixed", "variable"], choices=["fixed", "variable"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--new-tokens", type=int, default=128, help="fixed workload: tokens per row")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="variable workload: response limit")
    ap.add_argument("--seed", type=int, default=0, help="variable workload: sampling seed")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument(
        "--drop-min-frac", type=float, nargs="*", default=[], help="variable workload: HFEngine with these too"
    )
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per case (after one warm-up); the best counts")
    ap.add_argument("--out", default=str(RESULTS / "rollout_throughput.json"))
    args = ap.parse_args()

    rows = []
    for dtype in args.dtypes:
        model, tok = load_policy(args.model, dtype=dtype)
        model.eval()
        for workload in args.workloads:
            for batch in args.batch_sizes:
                row = {"dtype": dtype, **(run_fixed if workload == "fixed" else run_variable)(model, tok, batch, args)}
                rows.append(row)
                print_table(rows[-1:], list(rows[-1]))
    columns = [
        "dtype",
        "workload",
        "batch",
        "max_new",
        "engine_tokens",
        "generate_tokens",
        "engine_len_min_max",
        "hf_engine_tok_s",
        "hf_engine_kept_rows_tok_s",
        *[f"hf_engine_drop_min_frac_{f}_tok_s" for f in args.drop_min_frac if f > 0],
        "generate_tok_s",
        "speedup",
    ]
    print()
    print_table(rows, columns)
    write_json("rollout_throughput", rows, path=args.out, model=args.model, repeats=args.repeats, seed=args.seed)


if __name__ == "__main__":
    main()
