"""The training step of larger models, on one CUDA GPU or the CPU: seconds per step, its phases
and peak memory, for full fine-tuning and LoRA, on randomly initialised real architectures.

Only the packaged 135M model is at hand offline (and a GPU machine without network can fetch
no weights at all), and a step's speed and memory do not
depend on the weights' values. So each shape is built from its published configuration,
randomly initialised (seeded) on the device and saved once as a local model directory with the
packaged SmolLM2 tokenizer (a model's vocabulary may be larger than its tokenizer's, as Qwen2's
is). Responses have a fixed length (EOS ignored), so every run does the same work.

Each configuration is one ``ngrpo train`` (``trainer=gpu`` or ``trainer=cpu``) in its own process
(``vs_trl_workload.run_side``, the side-by-side benchmark's workload with our side only: 4 prompts
x 8 completions, GRPO with a k3 KL term, one AdamW step per rollout batch, the HF engine), so each peak is its own. The
first step of every run is dropped from the medians and reported as the run's warm-up:
``warmup_s`` is how much longer it took than the median step (first calls, kernel selection,
CUDA graphs recorded: ``graph_record_s`` of it), and ``warmup_pct_50`` its share of a 50-step
run's wall time; ``warmup_gen_s``, ``warmup_logprobs_s`` and ``warmup_update_s`` split it by phase
(each phase's first time less its median), ``startup_s`` is the process's time outside its steps
(imports, loading the models, the fit's setup). ``graphs`` says what the decoding graphs held:
``whole steps`` (the model, the explorer and the bookkeeping: rollout/step_graphs.py), ``model
step`` (the model's alone) or ``none`` (eager decoding). ``cuda_gib`` is the run's peak of allocated GPU memory
(``torch.cuda.max_memory_allocated``), ``reserved_gib`` what PyTorch's caching allocator held
at most, ``rss_gib`` the process's peak RSS (the figure of a CPU run). ``logprob_diff_max`` is the
largest gap between a sampled token's log-prob in the rollout and in the training forward that
rebuilds its inputs (``train/rollout_logprob_diff_max``, over the run's steps). ``logprobs_x_floor``
and ``update_x_floor`` are the reference log-prob pass's and the update's times over their matmul
FLOPs (``compute_floor.phase_flops``: a forward, and a forward and backward, of the step's tokens,
a group's prompt once) at the device's dense matmul rate, measured before the runs
(``matmul_tflops`` in the JSON's meta): near 1 a pass is as fast as its arithmetic allows.
``gen_x_floor`` is generation's time over its decoding steps' bandwidth floor
(``compute_floor.decode_floor_s``: each step reads every weight once and every row's keys and
values so far, at ``--bandwidth-gbs``, measured on a CPU, the data sheet's on a GPU); ``decode_ms``
is generation's time per token of a row (the prefill and sampling included) and
``decode_floor_ms`` a decoding step's mean floor. A run
that fails (out of memory, say) is reported with its reason; the others go on.

    python benchmarks/large_shapes.py --shapes smollm2-135m qwen2.5-1.5b --modes full lora
    python benchmarks/large_shapes.py --shapes qwen2.5-7b --modes lora --tokens 256 \\
        --extra model.gradient_checkpointing=true

``--profile`` runs ``torch.profiler`` over each run's last step (left out of the medians;
``--steps`` at least 3, since reading a profile back takes seconds that no measured step may
hold) and prints, per phase of that step (rollout, reward, log-probs, update), its host time,
its kernels' time on the device, the device's share of the host time (``busy``), the number of
kernels and the longest kernel; the JSON row's ``profile`` holds each phase's longest kernels
and host operations (``benchmarks/step_profile.py``). ``--trace-dir`` writes each profiled step's
Chrome trace as well (open it in Perfetto).

A machine without the built-in task's package (reasoning-gym) reads its problems from a file
written here first: ``--export-problems problems.jsonl``, then ``--problems problems.jsonl``
there (``data=files``: the same questions, rendered with the same chat template).

``--source`` is a directory with the tokenizer files and SmolLM2-135M's config.json (default: the
packaged model's directory; on a machine without network, a copy of those small files).
``--accelerator`` is ``gpu`` where CUDA is available, else ``cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    RESULTS,  # noqa: E402
    copy_tokenizer,
    print_table,
    write_json,
)
from compute_floor import decode_floor_s, matmul_rate, model_shape, phase_flops, read_bandwidth  # noqa: E402
from step_profile import phase_rows  # noqa: E402
from vs_trl_workload import GIB, Workload, run_side  # noqa: E402

# Published shapes (config.json of each model); None: the source directory's own config.
SHAPES: dict[str, dict | None] = {
    "smollm2-135m": None,
    "qwen2.5-1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    ),
    "qwen2.5-7b": dict(  # also DeepSeek-R1-Distill-Qwen-7B's shape (experiment=n-grpo-7b-lora)
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    ),
}
MODES = {"full": 0, "lora": 16}  # mode -> LoRA rank (0: full fine-tuning)


def model_dir(shape: str, source: Path, root: Path, dtype: str, device: str) -> Path:
    """A randomly initialised model of ``shape`` saved under ``root`` (built once, seeded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / f"{shape}-{dtype}"
    if (out / "config.json").is_file():
        return out
    base = AutoConfig.from_pretrained(source)
    spec = SHAPES[shape]
    config = base if spec is None else AutoConfig.for_model(**spec)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the tokenizer's special tokens
        setattr(config, key, getattr(base, key, None))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # initialised in the run's dtype: no float32 copy of a 7B model
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape}-", dir=root))
    model.save_pretrained(tmp)
    del model
    copy_tokenizer(source, tmp)
    tmp.rename(out)
    if device == "cuda":
        torch.cuda.empty_cache()  # the runs' processes get the whole GPU
    return out


def export_problems(path: Path) -> None:
    """The built-in task's training problems (the default run's) as JSON lines: problem, answer."""
    from ngrpo_lightning.build.data import build_problems
    from ngrpo_lightning.config import compose

    cfg = compose([])
    train, _ = build_problems(cfg.data, cfg.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"problem": p.question, "answer": p.answer}) + "\n" for p in train))
    print(f"wrote {len(train)} problems to {path}")


def summary(shape: str, mode: str, workload: Workload, result: dict, floor=None) -> dict:
    """One table row from a run's per-step records (the first step dropped). ``floor``: a
    :class:`~compute_floor.ModelShape`, the device's matmul rate (FLOP/s) and its memory
    bandwidth (bytes/s, or ``None``), for the log-prob pass's and the update's time over their
    matmul floor and generation's over its bandwidth floor (``*_x_floor``)."""
    row = {"shape": shape, "mode": mode, "dtype": workload.dtype, "tokens": workload.tokens}
    if "error" in result:
        print(result["error"]["log_tail"], flush=True)
        return {**row, "error": result["error"]["reason"], "log_tail": result["error"]["log_tail"]}
    steps = [s for s in result["steps"][1:] if "profile" not in s]  # a profiled step runs slower
    median = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    row.update(
        step_s=median("step_s"),
        gen_s=median("gen_s"),
        logprobs_s=median("logprobs_s"),
        update_s=median("update_s"),
        gen_tok_s=median("tokens") / median("gen_s"),
        cuda_gib=max(s.get("cuda_peak_bytes", 0) for s in result["steps"]) / GIB,
        reserved_gib=max(s.get("cuda_reserved_bytes", 0) for s in result["steps"]) / GIB,
        rss_gib=result["peak_rss_bytes"] / GIB,
        wall_s=result["wall_s"],
    )
    if floor is not None:  # each phase's time over its matmul FLOPs at the device's rate
        model, rate, bandwidth = floor
        for phase in ("logprobs", "update"):
            flops = [phase_flops(s, model, frozen=workload.lora_rank > 0)[phase] for s in steps]
            row[f"{phase}_x_floor"] = statistics.median(s[f"{phase}_s"] * rate / f for s, f in zip(steps, flops))
        value_bytes = 2 if workload.dtype == "bfloat16" else 4
        reads = [decode_floor_s(s, model, bandwidth, value_bytes) for s in steps] if bandwidth else [None]
        if None not in reads:  # generation over its decoding steps' bandwidth floor
            row["decode_ms"] = statistics.median(1e3 * s["gen_s"] * s["rows"] / s["tokens"] for s in steps)
            row["decode_floor_ms"] = statistics.median(1e3 * r * s["rows"] / s["tokens"] for s, r in zip(steps, reads))
            row["gen_x_floor"] = statistics.median(s["gen_s"] / r for s, r in zip(steps, reads))
    row["warmup_s"] = max(0.0, result["steps"][0]["step_s"] - row["step_s"])
    first = result["steps"][0]  # where the first step's excess went: each phase's first time less its median
    split = {p: first[f"{p}_s"] - row[f"{p}_s"] for p in ("gen", "logprobs", "update")}
    row.update({f"warmup_{p}_s": v for p, v in split.items()})
    row["warmup_other_s"] = first["step_s"] - row["step_s"] - sum(split.values())
    row["startup_s"] = result["wall_s"] - sum(s["step_s"] for s in result["steps"])  # imports, loading, teardown
    row["graph_record_s"] = sum(s.get("graph_record_s", 0.0) for s in result["steps"])
    whole = [s["whole_step_graphs"] for s in result["steps"] if "whole_step_graphs" in s]
    row["graphs"] = "none" if not whole else "whole steps" if min(whole) == 1 else "model step"
    row["warmup_pct_50"] = 100 * row["warmup_s"] / (50 * row["step_s"] + row["warmup_s"])
    row["logprob_diff_max"] = max(s.get("logprob_diff_max", float("nan")) for s in result["steps"])
    # every step's phases, the first and a profiled one included: whether a phase settles after the first step
    row["per_step"] = [
        {k: round(s[k], 4) for k in ("step_s", "gen_s", "logprobs_s", "update_s")} for s in result["steps"]
    ]
    profiled = [s for s in result["steps"] if "profile" in s]
    if profiled:
        row["profile"] = {"step_s": profiled[0]["step_s"], "phases": profiled[0]["profile"]}
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m"], choices=list(SHAPES))
    ap.add_argument("--modes", nargs="+", default=["full", "lora"], choices=list(MODES))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=Workload.tokens, help="new tokens per completion (exactly)")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is dropped)")
    ap.add_argument("--micro-batch", type=int, default=0, help="rows per forward/backward of the update (0: all)")
    ap.add_argument("--extra", nargs="*", default=[], help="more `ngrpo train` overrides for every run")
    ap.add_argument("--accelerator", default="gpu" if torch.cuda.is_available() else "cpu", choices=["gpu", "cpu"])
    ap.add_argument("--source", type=Path, default=None, help="tokenizer files and SmolLM2-135M's config.json")
    ap.add_argument("--problems", default="", help="a .jsonl of problems instead of the built-in task")
    ap.add_argument("--export-problems", type=Path, default=None, help="write the built-in task's problems; exit")
    ap.add_argument("--build-only", action="store_true", help="build the shapes' model folders under --models; exit")
    ap.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "ngrpo-large-shapes")
    ap.add_argument("--out", default=str(RESULTS / "large_shapes.json"))
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth (default: measured on a CPU)")
    ap.add_argument("--profile", action="store_true", help="profile each run's last step (out of the medians)")
    ap.add_argument("--trace-dir", type=Path, default=None, help="with --profile: the steps' Chrome traces here")
    args = ap.parse_args(argv)
    if args.export_problems:
        return export_problems(args.export_problems)
    if args.steps < 2 + args.profile:
        ap.error("--steps must be at least 2 (the first step of every run is dropped), 3 with --profile")
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        sys.exit("large_shapes.py: --accelerator gpu, but torch sees no CUDA device here")
    if args.source is None:
        from ngrpo_lightning.models.loading import resolve_model_path

        args.source = Path(resolve_model_path(Workload.model))
    device = "cuda" if args.accelerator == "gpu" else "cpu"
    args.models.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    threads = cores if device == "cpu" else min(8, cores)  # a GPU run's CPU side: Python, tokenizing
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    meta = {"device": device_name, "extra": args.extra, "micro_batch": args.micro_batch, "steps": args.steps}
    if args.build_only:
        for shape in args.shapes:
            print(model_dir(shape, args.source, args.models, args.dtype, device))
        return
    bandwidth = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else read_bandwidth() if device == "cpu" else None
    meta["bandwidth_gbs"] = bandwidth / 1e9 if bandwidth else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="large-shapes-") as work:
        for shape in args.shapes:
            path = model_dir(shape, args.source, args.models, args.dtype, device)
            model = model_shape(str(path))
            rate = matmul_rate(model, args.dtype, device=device)
            meta.setdefault("matmul_tflops", {})[shape] = rate / 1e12
            for mode in args.modes:
                workload = Workload(
                    model=str(path),
                    dtype=args.dtype,
                    tokens=args.tokens,
                    steps=args.steps,
                    saves=False,
                    threads=threads,
                    lora_rank=MODES[mode],
                    micro_batch=args.micro_batch,
                    problems=str(Path(args.problems).resolve()) if args.problems else "",
                    accelerator=args.accelerator,
                    ours_overrides=tuple(args.extra),
                    profile_step=args.steps - 1 if args.profile else 0,  # the last: stopping the profiler takes seconds
                    profile_trace=str(args.trace_dir / f"{shape}-{mode}.trace.json.gz") if args.trace_dir else "",
                )
                result = run_side("ours", workload, Path(work), len(rows))
                rows.append(summary(shape, mode, workload, result, floor=(model, rate, bandwidth)))
                shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}
                print({k: v for k, v in shown.items() if k not in ("log_tail", "profile", "per_step")}, flush=True)
                write_json("large_shapes", rows, args.out, **meta)  # after each run: a later failure loses nothing
    columns = ["shape", "mode", "dtype", "graphs", "tokens", "step_s", "gen_s", "logprobs_s", "update_s", "gen_tok_s"]
    more = ["decode_ms", "gen_x_floor", "logprobs_x_floor", "update_x_floor", "warmup_s", "warmup_pct_50"]
    more += ["logprob_diff_max"]
    more += ["cuda_gib", "reserved_gib", "rss_gib", "error"]
    print_table(rows, [*columns, *more])
    print("\nthe first step's excess over the median step (warmup_s), by phase; startup_s: outside the steps")
    warm = ["warmup_s", "warmup_gen_s", "warmup_logprobs_s", "warmup_update_s", "warmup_other_s", "graph_record_s"]
    print_table([r for r in rows if "error" not in r], ["shape", "mode", *warm, "startup_s"])
    if args.profile:
        print("\nthe profiled step, by phase (device: its kernels' time; busy: device / host)")
        phases = []
        for row in rows:
            phases += phase_rows({"shape": row["shape"], "mode": row["mode"]}, row.get("profile", {}).get("phases", {}))
        print_table(phases, ["shape", "mode", "phase", "host_s", "device_s", "busy", "kernels", "graphs", "longest"])


if __name__ == "__main__":
    main()
