"""vLLM rollouts: plain vLLM vs vLLM with neighbor mixing inside its loop vs HFEngine.

All three sample at temperature 1 for exactly ``--new-tokens`` tokens per row (EOS
suppressed) from the same chat prompts of the built-in task, on the packaged model in fp32.
Neighbor mixing uses the paper's setting (k=3, rho=0.1), one explorer for the whole run (its
neighbor cache fills as a training run's would). Target: mixing >= 0.95x plain vLLM.

The arms alternate within each round (plain, mixing, HFEngine, then again), so that a change
in the machine's load hits every arm alike; each arm's best round counts.

    .venv/bin/python benchmarks/vllm_throughput.py                        # batch 8 and 32, 256 tokens
    .venv/bin/python benchmarks/vllm_throughput.py --batch-sizes 8 --new-tokens 64 --repeats 1 --no-hf
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import arithmetic_prompt_ids, print_table, write_json  # noqa: E402

from ngrpo_lightning.explorers import NeighborMixingExplorer, TemperatureExplorer  # noqa: E402
from ngrpo_lightning.models.loading import load_policy  # noqa: E402
from ngrpo_lightning.rollout import HFEngine  # noqa: E402


def alternating_best(arms: dict, repeats: int) -> tuple[dict[str, float], dict]:
    """Best wall time of each arm over ``repeats`` rounds that run the arms in turn, after one
    warm-up round; and each arm's last result."""
    results = {name: fn() for name, fn in arms.items()}
    best = dict.fromkeys(arms, float("inf"))
    for _ in range(repeats):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            results[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per batch size (after one warm-up round)")
    ap.add_argument("--rho", type=float, default=0.1)
    ap.add_argument("--no-hf", action="store_true", help="leave HFEngine out (it takes most of the time)")
    args = ap.parse_args()

    from ngrpo_lightning.rollout.vllm_engine import VLLMEngine

    model, tok = load_policy(args.model)
    model.eval()
    # ignore_eos: exactly new_tokens per row
    vllm = VLLMEngine.from_policy(model, tok, max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
    hf = HFEngine(model, tok, max_new_tokens=args.new_tokens, ignore_eos=True)
    plain, mixing = TemperatureExplorer(temperature=1.0), NeighborMixingExplorer(k=3, rho=args.rho)
    rows = []
    for batch in args.batch_sizes:
        prompts = arithmetic_prompt_ids(tok, batch)
        tokens = batch * args.new_tokens
        arms = {"vllm": partial(vllm.generate, prompts, plain), "mixing": partial(vllm.generate, prompts, mixing)}
        if not args.no_hf:
            arms["hf"] = partial(hf.generate, prompts, plain)
        best, out = alternating_best(arms, args.repeats)
        assert int(out["vllm"].response_mask.sum()) == tokens == int(out["mixing"].response_mask.sum())
        row = {
            "batch": batch,
            "new_tokens": args.new_tokens,
            "vllm_tok_s": tokens / best["vllm"],
            "vllm_mixing_tok_s": tokens / best["mixing"],
            "mixing_vs_vllm": best["vllm"] / best["mixing"],
            "mixed_frac": len(out["mixing"].records) / tokens,
        }
        if "hf" in best:
            row.update(hf_engine_tok_s=tokens / best["hf"], vllm_vs_hf=best["hf"] / best["vllm"])
        rows.append(row)
        print_table(rows[-1:], list(rows[-1]))
    vllm.close()
    print()
    print_table(rows, list(rows[0]))
    write_json(
        "vllm_throughput",
        rows,
        model=args.model,
        repeats=args.repeats,
        rho=args.rho,
        dtype="float32",
        runner=vllm.runner_class,
    )


if __name__ == "__main__":
    main()
