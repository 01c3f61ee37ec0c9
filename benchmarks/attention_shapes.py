"""What a new pass width costs: a training pass (the decoder's forward and backward, rows left
padded, as the framework's log-prob and training passes are) at a run of widths never seen before,
then at the same widths again, with transformers' ``sdpa`` and with the backend's ``sdpa_gqa``.

On a GPU, PyTorch's cuDNN attention builds a plan for every new shape it meets (batch, query and
key lengths), and a run's passes come at a new width almost every time: each pass is cut to its
own rows' longest sequence. ``sdpa_gqa`` computes such a pass's attention at one of a bounded set
of widths (``backends/width_buckets.py``: multiples of 64 up to 1,024, then 16 per doubling). The
first time through less the second is what the new shapes cost; each run is a process of its own,
so none finds another's plans. The same widths in the same order every run.

Two more things each run can change, for the first-use costs a run's warm-up pays:

* ``no-cudnn``: cuDNN's attention turned off (``torch.backends.cuda.enable_cudnn_sdp(False)``), so
  PyTorch takes its memory-efficient kernel for a masked pass, compiled ahead with PyTorch;
* ``cold``: the driver's on-disk cache of compiled kernels off (``CUDA_CACHE_DISABLE=1``), as for a
  machine's first process. cuDNN's attention kernels are generated at run time; if the driver's
  cache is what spares a later process their compilation, the ``cold`` row's first pass
  (``first pass s``: the process's first, at width 16) and its new widths cost more;
* ``cold-files``: torch's and NVIDIA's shared libraries asked out of the OS page cache first
  (``posix_fadvise``), so the process reads the kernels it loads from disk, as a machine's first
  process does (pages another process has mapped stay cached).

On the CPU both run (a dry run of the script: the CPU plans nothing per shape, and ``sdpa_gqa``
pads nothing there).

    python benchmarks/attention_shapes.py                                  # the packaged model
    python benchmarks/attention_shapes.py --model /tmp/large-shapes/qwen2.5-1.5b-bfloat16 --widths 150:360
    python benchmarks/attention_shapes.py --runs sdpa sdpa_gqa sdpa_gqa,no-cudnn sdpa_gqa,cold sdpa_gqa,no-cudnn,cold

Prints a table and writes JSON to benchmarks/results/ (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
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


RUN_OPTIONS = ("no-cudnn", "cold", "cold-files")


def drop_libraries_from_os_cache() -> int:
    """Ask the OS to drop torch's and NVIDIA's shared libraries from its page cache (``posix_fadvise``
    DONTNEED: no privileges needed; what a process has mapped stays). Returns their size in bytes."""
    import importlib.util

    folders = [Path(torch.__file__).parent / "lib"]
    nvidia = importlib.util.find_spec("nvidia")
    folders += [Path(p) for p in (nvidia.submodule_search_locations or [])] if nvidia else []
    size = 0
    for library in (f for folder in folders for f in folder.rglob("*.so*") if f.is_file()):
        fd = os.open(library, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        size += library.stat().st_size
    return size


def parse_run(spec: str) -> tuple[str, set[str]]:
    """``"sdpa_gqa,no-cudnn,cold"`` -> ``("sdpa_gqa", {"no-cudnn", "cold"})``."""
    attention, *options = spec.split(",")
    unknown = set(options) - set(RUN_OPTIONS)
    if unknown:
        raise SystemExit(f"--runs {spec}: unknown option(s) {sorted(unknown)}; allowed: {', '.join(RUN_OPTIONS)}")
    return attention, set(options)


def one_run(args) -> dict:
    """Time the passes of the run ``args.one`` in this process; returns its row."""
    from ngrpo_lightning.models.loading import load_policy

    attention, options = parse_run(args.one)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "no-cudnn" in options:
        torch.backends.cuda.enable_cudnn_sdp(False)
    model, _ = load_policy(args.model, dtype=args.dtype, device=device, attn_implementation=attention)
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

    first_pass = one_pass(16)  # the process's own first work (libraries, kernels), at a width not in the run
    widths = widths_of(args.widths, args.calls, args.seed)
    first = [one_pass(w) for w in widths]
    again = [one_pass(w) for w in widths]
    padded = device == "cuda" and attention == "sdpa_gqa"
    shapes = len({bucket_width(w) if padded else w for w in widths})
    return {
        "attention": attention,
        "cuDNN": "off" if "no-cudnn" in options else "on",
        "driver cache": "off" if "cold" in options else "kept",
        "libraries": "from disk" if "cold-files" in options else "cached",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "passes": len(widths),
        "attention widths": shapes,
        "first pass s": round(first_pass, 3),
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
    ap.add_argument(
        "--runs", nargs="+", default=["sdpa", "sdpa_gqa"],
        help="each a process: an attention (sdpa, sdpa_gqa), then options after commas: " + ", ".join(RUN_OPTIONS),
    )  # fmt: skip
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one run, its row as JSON
    ap.add_argument("--out", default=str(RESULTS / "attention_shapes.json"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(args)))
        return
    widths_of(args.widths, args.calls, args.seed)  # bad arguments fail here, not in a child
    for spec in args.runs:
        parse_run(spec)
    rows = []
    for spec in args.runs:
        options = parse_run(spec)[1]
        env = {**os.environ, **({"CUDA_CACHE_DISABLE": "1"} if "cold" in options else {})}
        if "cold-files" in options:
            print(f"{spec}: {drop_libraries_from_os_cache() / 2**20:,.0f} MiB of libraries dropped from the OS cache")
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", spec]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = round(time.perf_counter() - start, 2)  # the whole process: imports, loading, its passes
        if done.returncode:  # reported, and the other runs go on
            print(f"{spec}: the child process failed:\n{done.stderr[-3000:]}", flush=True)
            rows.append({"attention": spec, "error": done.stderr[-300:].strip().splitlines()[-1:]})
        else:
            rows.append({**json.loads(done.stdout.strip().splitlines()[-1]), "process s": wall})
        write_json("attention_shapes", rows, args.out, model=args.model, dtype=args.dtype, widths=args.widths)
    print(f"{args.model} ({args.dtype}), {args.rows} rows, {args.calls} passes at widths {args.widths}, then again")
    print_table(rows, list(dict.fromkeys(k for r in rows for k in r)))


if __name__ == "__main__":
    main()
