"""``harness.py widths``: what a training pass at a width never seen before costs, with
transformers' ``sdpa`` and with the backend's ``sdpa_gqa`` (its attention at a bounded set of
widths, ``backends/width_buckets.py``).

A pass is the decoder's forward and backward over rows left padded, as the log-prob and training
passes run. Each run, a process of its own (so none finds another's attention plans), makes one
pass at width 16 (the process's first work: ``first pass s``), then ``--calls`` passes at widths
drawn from ``--widths`` and the same widths again: the first time through less the second is
what the new shapes cost. A run is ``ATTENTION[,OPTION...]``; options:

* ``no-cudnn``: cuDNN's attention off (PyTorch takes its memory-efficient kernel, compiled ahead);
* ``cold``: the driver's on-disk kernel cache off (``CUDA_CACHE_DISABLE=1``), as a machine's first
  process finds it;
* ``cold-files``: torch's and NVIDIA's shared libraries dropped from the OS page cache first
  (``posix_fadvise``), so the process reads the kernels it loads from disk.

On a CPU it is a dry run: nothing is planned per shape there.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

OPTIONS = ("no-cudnn", "cold", "cold-files")


def parse_run(spec: str) -> tuple[str, set[str]]:
    """``"sdpa_gqa,no-cudnn,cold"`` -> ``("sdpa_gqa", {"no-cudnn", "cold"})``."""
    attention, *options = spec.split(",")
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise SystemExit(f"widths: run {spec}: unknown option(s) {sorted(unknown)}; allowed: {', '.join(OPTIONS)}")
    return attention, set(options)


def widths_of(spec: str, calls: int, seed: int) -> list[int]:
    """``calls`` different widths from ``lo:hi``, in a seeded order."""
    lo, hi = (int(x) for x in spec.split(":"))
    if hi - lo + 1 < calls:
        raise SystemExit(f"widths: {spec} holds fewer than {calls} widths")
    return random.Random(seed).sample(range(lo, hi + 1), calls)


def drop_libraries_from_os_cache() -> int:
    """Ask the OS to drop torch's and NVIDIA's shared libraries from its page cache; their bytes."""
    import importlib.util

    import torch

    nvidia = importlib.util.find_spec("nvidia")
    folders = [Path(torch.__file__).parent / "lib"]
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


def one_run(settings: dict) -> dict:
    """Time the passes of one run in this process; its row."""
    import torch

    from ngrpo_lightning.backends.width_buckets import bucket_width
    from ngrpo_lightning.models.loading import load_policy

    attention, options = parse_run(settings["run"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "no-cudnn" in options:
        torch.backends.cuda.enable_cudnn_sdp(False)
    model, _ = load_policy(settings["model"], dtype=settings["dtype"], device=device, attn_implementation=attention)
    decoder, vocab, rows = model.get_decoder(), model.config.vocab_size, settings["rows"]
    g = torch.Generator().manual_seed(0)

    def one_pass(width: int) -> float:
        ids = torch.randint(3, vocab, (rows, width), generator=g)
        mask = torch.ones_like(ids)
        for row in range(1, rows):  # left padding; the first row is the longest
            mask[row, : int(torch.randint(0, width // 4 + 1, (), generator=g))] = 0
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        ids, mask = ids.to(device), mask.to(device)
        sync()
        start = time.perf_counter()
        decoder(input_ids=ids, attention_mask=mask).last_hidden_state.float().square().mean().backward()
        sync()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    first_pass = one_pass(16)
    widths = widths_of(settings["widths"], settings["calls"], settings["seed"])
    first, again = [one_pass(w) for w in widths], [one_pass(w) for w in widths]
    shapes = len({bucket_width(w) if device == "cuda" and attention == "sdpa_gqa" else w for w in widths})
    return {
        "run": settings["run"], "device": device, "attention widths": shapes, "first pass s": first_pass,
        "first time s": sum(first), "again s": sum(again), "per new width s": (sum(first) - sum(again)) / shapes,
        "per pass, again, ms": 1000 * sum(again) / len(again),
    }  # fmt: skip


def run(args) -> None:
    from common import print_table, write_record

    widths_of(args.widths, args.calls, args.seed)  # bad arguments fail here, not in a child
    rows = []
    for spec in args.runs:
        options = parse_run(spec)[1]
        if "cold-files" in options:
            print(f"{spec}: {drop_libraries_from_os_cache() / 2**20:,.0f} MiB of libraries dropped from the OS cache")
        env = {**os.environ, **({"CUDA_CACHE_DISABLE": "1"} if "cold" in options else {})}
        settings = {k: getattr(args, k) for k in ("model", "dtype", "rows", "widths", "calls", "seed")} | {"run": spec}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, json.dumps(settings)], capture_output=True, text=True, env=env)
        if done.returncode:  # reported; the other runs go on
            print(f"{spec}: the run failed:\n{done.stderr[-3000:]}", flush=True)
            rows.append({"run": spec, "error": (done.stderr.strip().splitlines() or [""])[-1][:300]})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]) | {"process s": time.perf_counter() - start})
    print_table(rows)
    device = next((r["device"] for r in rows if "device" in r), "cpu")
    workload = f"{args.model}, {args.dtype}, {args.rows} rows, {args.calls} passes at widths {args.widths}, then again"
    write_record("widths", device, workload, "per new width s", True, args.out, rows=rows)


if __name__ == "__main__":
    print(json.dumps(one_run(json.loads(sys.argv[1]))))
