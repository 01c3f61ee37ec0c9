"""How often a rollout makes the host wait for the device, per explorer and decoding mode, counted
from torch's dispatcher (``HostSyncs``), so on any machine: the waits of one rollout at two
response lengths, outside the model (the engine's bookkeeping and the explorer) and inside it.
A count that grows with the length is a wait per token; on a GPU each one idles the device
between tokens and rules out recording the step as a CUDA graph. The last column counts the
kernels launched outside the model per decoding step (views and allocations left out): where the
model's step replays from a CUDA graph, these are still launched one by one from Python.

    python benchmarks/host_syncs.py                  # tiny model, every built-in explorer
    python benchmarks/host_syncs.py --model smollm2-135m-instruct --explorers neighbor gaussian
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, arithmetic_prompt_ids, print_table, write_json  # noqa: E402
from update_ops import NOT_KERNELS  # noqa: E402

from ngrpo_lightning.explorers import EXPLORERS  # noqa: E402
from ngrpo_lightning.models.loading import load_policy  # noqa: E402
from ngrpo_lightning.rollout import HFEngine  # noqa: E402
from ngrpo_lightning.rollout.host_syncs import HostSyncs  # noqa: E402

SETTINGS = {"neighbor": {"rho": 0.5}, "topk": {"rho": 0.5}, "topk_gumbel": {"rho": 0.5}}


class Counted(HostSyncs):
    """:class:`HostSyncs` that also counts the kernels dispatched outside the ignored modules (views
    and allocations left out): the launches a GPU's decoding loop makes between its model steps."""

    def __init__(self, ignore=()):
        super().__init__(ignore)
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside and str(func.overloadpacket).removeprefix("aten.") not in NOT_KERNELS:
            self.kernels += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def waits(model, tok, prompts, name: str, tokens: int, static: bool, full_table: bool) -> tuple[int, int, int]:
    """(waits outside the model, waits inside it, kernels outside it) of one rollout, after a first
    one (indices built)."""
    options = dict(SETTINGS.get(name, {}))
    if name == "neighbor":
        options["precompute"] = full_table
    explorer = EXPLORERS.resolve(name)(**options)
    engine = HFEngine(model, tok, max_new_tokens=tokens, seed=0, checks_every=10**6, static_cache=static)
    engine.generate(prompts[:1], explorer, n=2)
    with Counted(ignore=[model]) as syncs:
        engine.generate(prompts, explorer, n=2)
    return len(syncs.ops), len(syncs.ignored_ops), syncs.kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--explorers", nargs="*", default=sorted(EXPLORERS))
    ap.add_argument("--tokens", type=int, nargs=2, default=[8, 16])
    ap.add_argument("--out", default=str(RESULTS / "host_syncs.json"))
    args = ap.parse_args()
    model, tok = load_policy(args.model)
    prompts = arithmetic_prompt_ids(tok, 4)
    rows = []
    cases = [(name, False, True) for name in args.explorers]
    if "neighbor" in args.explorers:
        cases.append(("neighbor", False, False))  # the CPU's lazily filled table
    cases.append(("temperature", True, True))  # the static cache
    for name, static, full_table in cases:
        counts = [waits(model, tok, prompts, name, n, static, full_table) for n in args.tokens]
        # kernels per decoding step: their growth between the two lengths (a rollout's fixed part cancels)
        per_step = (counts[-1][2] - counts[0][2]) / (args.tokens[-1] - args.tokens[0])
        rows.append(
            {
                "explorer": name + ("" if full_table else " (lazy table)"),
                "cache": "static" if static else "growing",
                **{f"outside, {n} tokens": c[0] for n, c in zip(args.tokens, counts)},
                **{f"model, {n} tokens": c[1] for n, c in zip(args.tokens, counts)},
                "kernels per step, outside": round(per_step, 1),
            }
        )
    print(
        f"{args.model}: waits for the device in one rollout of {len(prompts)} prompts x 2 (host looks every 10^6 steps)"
    )
    print_table(rows, list(rows[0]))
    write_json("host_syncs", rows, args.out, model=args.model)


if __name__ == "__main__":
    main()
