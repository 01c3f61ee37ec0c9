"""vLLM rollouts: plain vLLM vs vLLM with neighbor mixing inside its loop vs HFEngine.

All three sample at temperature 1 for exactly ``--new-tokens`` tokens per row (EOS
suppressed) from the same chat prompts of the built-in task, on the packaged model in fp32.
Neighbor mixing uses the paper's setting (k=3, rho=0.1). Target: mixing >= 0.9x plain vLLM.

    .venv/bin/python benchmarks/vllm_throughput.py                        # batch 8 and 32, 256 tokens
    .venv/bin/python benchmarks/vllm_throughput.py --batch-sizes 8 --new-tokens 64 --repeats 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import arithmetic_prompt_ids, best_of, print_table, write_json  # noqa: E402

from ngrpo_lightning.explorers import NeighborMixingExplorer, TemperatureExplorer  # noqa: E402
from ngrpo_lightning.models import load_policy  # noqa: E402
from ngrpo_lightning.rollout import HFEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per case (after one warm-up); the best counts")
    ap.add_argument("--rho", type=float, default=0.1)
    args = ap.parse_args()

    from ngrpo_lightning.rollout.vllm_engine import VLLMEngine

    model, tok = load_policy(args.model)
    model.eval()
    vllm = VLLMEngine(str(model.name_or_path), tok, max_new_tokens=args.new_tokens, dtype="float32")
    hf = HFEngine(model, tok, max_new_tokens=args.new_tokens)
    vllm.eos_ids = hf.eos_ids = []  # exactly new_tokens per row
    plain, mixing = TemperatureExplorer(temperature=1.0), NeighborMixingExplorer(k=3, rho=args.rho)
    rows = []
    for batch in args.batch_sizes:
        prompts = arithmetic_prompt_ids(tok, batch)
        tokens = batch * args.new_tokens
        t_plain, out = best_of(lambda: vllm.generate(prompts, plain), args.repeats)
        t_mix, mixed = best_of(lambda: vllm.generate(prompts, mixing), args.repeats)
        t_hf, _ = best_of(lambda: hf.generate(prompts, plain), args.repeats)
        assert int(out.response_mask.sum()) == tokens == int(mixed.response_mask.sum())
        rows.append({"batch": batch, "new_tokens": args.new_tokens, "vllm_tok_s": tokens / t_plain,
                     "vllm_mixing_tok_s": tokens / t_mix, "hf_engine_tok_s": tokens / t_hf,
                     "mixing_vs_vllm": t_plain / t_mix, "vllm_vs_hf": t_hf / t_plain,
                     "mixed_frac": len(mixed.records) / tokens})
        print_table(rows[-1:], list(rows[-1]))
    vllm.close()
    print()
    print_table(rows, list(rows[0]))
    write_json("vllm_throughput", rows, model=args.model, repeats=args.repeats, rho=args.rho, dtype="float32")


if __name__ == "__main__":
    main()
