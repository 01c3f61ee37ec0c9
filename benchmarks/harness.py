"""The benchmarks, one command: ``python benchmarks/harness.py QUESTION [options]``.

Questions (each writes a dated record, ``results/records/<question>[-<speed-up>]-<device>-<date>.json``,
or ``--out``):

    speedup NAME   a workload with one speed-up on and off, alternated (speedup.py)
    floor          the workload's step against its compute floor, measured in the same run (floor.py)
    vs_trl         our side and TRL's GRPOTrainer on the side-by-side workload, alternated (vs_trl.py)
    main_job       the whole default command as a user runs it: wall time, peak RSS (main_job.py)
    profile        where a step's time and memory go, per phase (step_phases.py)
    decoding       HFEngine's decoding modes side by side, a GPU's graphs among them (decoding.py)
    widths         what a pass at a width never seen before costs, a GPU's attention plans (widths.py)

and two helpers for a machine without network: ``models`` (models of published shapes, randomly
initialised) and ``problems`` (the built-in task's problems as a file). The workloads are named in
workloads.py: ``default`` (the main job) and ``side_by_side`` (the workload run against TRL).

    python benchmarks/harness.py speedup packed_products --pairs 2
    python benchmarks/harness.py speedup nondeterministic
    python benchmarks/harness.py main_job --via ngrpo script --pairs 2
    python benchmarks/harness.py floor --modes full lora --profile
    python benchmarks/harness.py vs_trl --sides ours trl --runs 2 --no-saves
"""

from __future__ import annotations

import argparse
import importlib
import tempfile
from dataclasses import fields
from pathlib import Path

from workloads import SHAPES, WORKLOADS, Workload

# question -> its module (each has run(args, workload) where it takes a workload, else run(args))
QUESTIONS = {"speedup": "speedup", "floor": "floor", "vs_trl": "vs_trl", "profile": "step_phases",
             "main_job": "main_job", "decoding": "decoding", "widths": "widths"}  # fmt: skip

# options of the side-by-side workload: --flag -> Workload field (the default job takes only steps, extra, lora_rank)
WORKLOAD_OPTIONS = {"model": str, "dtype": str, "prompts": int, "group": int, "tokens": int, "micro_batch": int,
                    "lora_rank": int, "engine": str, "accelerator": str, "threads": int, "problems": str}  # fmt: skip
DEFAULT_JOB_OPTIONS = {"steps", "extra", "lora_rank"}


def workload_options(parser: argparse.ArgumentParser, names: tuple[str, ...], default: str) -> None:
    """The options that choose and change a workload; unset ones keep the workload's values."""
    parser.set_defaults(options=parser)  # where a wrong combination is reported
    parser.add_argument("--workload", choices=names, default=default, help=f"workloads.py (default {default})")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (the first is left out of the medians)")
    for name, kind in WORKLOAD_OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind)
    parser.add_argument("--natural", action="store_const", const=True, help="EOS on: natural lengths, at most --tokens")
    parser.add_argument("--no-saves", dest="saves", action="store_const", const=False, help="no checkpoints")
    parser.add_argument("--extra", nargs="+", action="extend", default=[], help="more `ngrpo train` overrides, last")


def workload_from(args) -> Workload:
    known = {f.name for f in fields(Workload)} - {"name"}  # the workload's name is --workload
    changes = {k: v for k, v in vars(args).items() if k in known and v is not None and k != "extra"}
    if args.extra:
        changes["extra"] = tuple(args.extra)
    if changes.get("problems"):
        changes["problems"] = str(Path(changes["problems"]).resolve())
    if args.workload == "default" and set(changes) - DEFAULT_JOB_OPTIONS:
        unused = sorted(set(changes) - DEFAULT_JOB_OPTIONS)
        args.options.error(f"--workload default takes only --steps, --extra and --lora-rank, not {unused}")
    return WORKLOADS[args.workload](**changes)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="question", required=True)
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--out", help="write the record here (default: results/records/)")

    p = sub.add_parser("speedup", parents=[out], help="a workload with one speed-up on and off, alternated")
    p.add_argument("speedup", metavar="NAME", help="a backend speed-up (backend.disable/enable) or nondeterministic")
    workload_options(p, ("default", "side_by_side"), "default")
    p.add_argument("--pairs", type=int, default=2, help="runs of each arm, alternated")
    p.add_argument("--metric", choices=["step_s", "peak_gib"], default="step_s")
    p.add_argument("--allocator", choices=["launcher", "system"], default="launcher", help="system: the C malloc")

    for name, text in (("floor", "the step against its compute floor"), ("vs_trl", "ours and TRL's GRPOTrainer")):
        p = sub.add_parser(name, parents=[out], help=text)
        workload_options(p, ("side_by_side",), "side_by_side")
        p.add_argument("--runs", type=int, default=1 if name == "floor" else 2, help="runs of each mode or side")
        p.add_argument("--bandwidth-gbs", type=float, help="a GPU's memory bandwidth (a CPU's is measured)")
    sub.choices["floor"].add_argument("--modes", nargs="+", choices=["full", "lora"], default=["full"])
    sub.choices["floor"].add_argument("--profile", action="store_true", help="profile each run's last step")
    sub.choices["floor"].add_argument("--trace-dir", type=Path, help="with --profile: Chrome traces here")
    sub.choices["vs_trl"].add_argument("--sides", nargs="+", choices=["ours", "trl", "trl-ac"], default=["ours", "trl"])

    p = sub.add_parser("main_job", parents=[out], help="the whole default command: wall time, peak RSS")
    p.add_argument("--via", nargs="+", default=["make"], help="ways, alternated: make, ngrpo or script, each with "
                   "environment variables it runs with after commas (ngrpo,THP_MEM_ALLOC_ENABLE=0)")  # fmt: skip
    p.add_argument("--pairs", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("overrides", nargs="*", help="`ngrpo train` overrides (after --)")

    p = sub.add_parser("profile", parents=[out], help="where a step's time and memory go, per phase")
    workload_options(p, ("default", "side_by_side"), "side_by_side")
    p.add_argument("--trim", action="store_true", help="hand freed heap memory back before each phase")
    p.add_argument("--trace", type=Path, help="the profiled step's Chrome trace here (.gz: gzipped)")
    p.add_argument("--allocator", choices=["launcher", "system"], default="launcher", help="system: the C malloc")

    p = sub.add_parser("decoding", parents=[out], help="HFEngine's decoding modes side by side")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bandwidth-gbs", type=float)
    p.add_argument("--modes", nargs="+", help="decoding.MODES (default: growing, static, and graphs on a GPU)")
    p.add_argument("--enable", nargs="+", default=[], help="backend speed-ups to turn on (backend.enable)")
    p.add_argument("--problems", default="", help="a .jsonl of problems instead of the built-in task")

    p = sub.add_parser("widths", parents=[out], help="what a pass at a new width costs")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=8, help="rows per pass")
    p.add_argument("--widths", default="100:200", help="lo:hi, the pass widths drawn from")
    p.add_argument("--calls", type=int, default=16, help="passes, each at a width of its own")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", nargs="+", default=["sdpa", "sdpa_gqa"], help="ATTENTION[,no-cudnn][,cold][,cold-files]")

    p = sub.add_parser("models", help="build models of published shapes (random weights)")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["smollm2-135m"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "ngrpo-large-shapes")
    p.add_argument("--source", type=Path, help="the tokenizer files and SmolLM2-135M's config.json")

    p = sub.add_parser("problems", help="the built-in task's problems as a .jsonl")
    p.add_argument("path", type=Path)
    return ap


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.question in ("models", "problems"):
        import shapes

        return shapes.build(args) if args.question == "models" else shapes.export_problems(args)
    module = importlib.import_module(QUESTIONS[args.question])
    if args.question == "main_job":
        return module.run(args, WORKLOADS["default"](steps=args.steps, extra=tuple(args.overrides)))
    if args.question in ("decoding", "widths"):
        return module.run(args)
    return module.run(args, workload_from(args))


if __name__ == "__main__":
    main()
