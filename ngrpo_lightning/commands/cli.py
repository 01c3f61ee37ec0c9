"""The ``ngrpo`` command line.

    ngrpo train [key=value ...]     train (Hydra overrides: group=option, a.b=value)
    ngrpo train --help              list the config groups and their options
    ngrpo config [key=value ...]    print the composed config and exit
    ngrpo eval [key=value ...]      pass@k evaluation (conf/eval.yaml; see docs/evaluation.md)
    ngrpo diagnose drift|rollouts [key=value ...]
                                    semantic-drift pilot / explorers side by side (docs/diagnostics.md)
    ngrpo export <checkpoint | run output_dir | MLflow run id> <out_dir>
                                    a trained policy as a Hugging Face model (docs/checkpoints.md)
    ngrpo env                       the allocator and OpenMP environment the command runs in, NAME=value lines

Hydra composes the config from ``conf/``; a config error prints one line naming the key and exits with status 2."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import NoReturn

from omegaconf import DictConfig, OmegaConf

from ngrpo_lightning.config import ConfigError, compose, config_dir, group_options

# Only what the cheap paths need is imported here (``--help``, ``ngrpo config``, a config that does not
# compose), so they answer before torch and Lightning load; each command imports its own module.


def __getattr__(name: str):
    """``from ngrpo_lightning.commands.cli import train``: the training job, imported on first use."""
    if name == "train":
        from ngrpo_lightning.commands.train import train

        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


COMMAND_ENV = ("LD_PRELOAD", "MIMALLOC_PURGE_DELAY", "MIMALLOC_ALLOW_THP", "GOMP_SPINCOUNT")  # `ngrpo env` prints
# Each command's config file in conf/: what its --help describes.
CONFIG_FILES = {"train": "config", "config": "config", "eval": "eval", "compare": "compare", "diagnose": "diagnose"}


def print_command_help(command: str = "train") -> None:
    """``ngrpo <command> --help``: the config groups with their options, the usage lines and, but for
    train, the command's own keys with their comments from its config file."""
    lines = (config_dir() / f"{CONFIG_FILES[command]}.yaml").read_text().splitlines()
    defaults = OmegaConf.create("\n".join(lines)).get("defaults", [])
    groups = [g for entry in defaults if isinstance(entry, DictConfig) for g in entry]
    print("Config groups (select with group=option; override any key with a.b=value):")
    for g in groups:
        print(f"  {g:<10} {', '.join(group_options(g))}")
    if command in ("train", "config"):
        print(
            "\nExamples:\n  ngrpo train experiment=ngrpo\n  ngrpo train model=tiny trainer.max_steps=2 optim.lr=1e-5"
            "\n  ngrpo config experiment=grpo   # print the composed config, every key"
        )
        return
    usage = [line.removeprefix("#").strip() for line in lines[: _first_key(lines)] if line.startswith("#   ngrpo")]
    print("\nExamples:\n" + "\n".join(f"  {line}" for line in usage))
    keys = lines[_first_key(lines, after_defaults=True) :]
    print(f"\nKeys (conf/{CONFIG_FILES[command]}.yaml):\n" + "\n".join(f"  {line}".rstrip() for line in keys).rstrip())


def _first_key(lines: list[str], after_defaults: bool = False) -> int:
    """Index of the first top-level line (``defaults:``), or with ``after_defaults`` of the first key after it."""
    first = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    if not after_defaults:
        return first
    return next(i for i in range(first + 1, len(lines)) if lines[i] and not lines[i].startswith(("#", " ", "-")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ngrpo", description="RL for language models on verifiable math with pluggable exploration."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("train", "train a policy"),
        ("eval", "pass@k evaluation of a policy"),
        ("config", "print the composed config"),
        ("compare", "trained arms side by side (Pass@k with intervals, curves) from MLflow"),
    ):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("-h", "--help", action="store_true")
        if name == "train":
            p.add_argument("-m", "--multirun", action="store_true", help="a sweep: every combination of a,b values")
            p.add_argument(
                "-v", "--verbose", action="store_true", help="the libraries' own output too (logger.verbose=true)"
            )
        p.add_argument("overrides", nargs="*", help="Hydra overrides: group=option or key=value")
    p = sub.add_parser("export", help="a trained policy as a Hugging Face model directory")
    p.add_argument(
        "source", help="a checkpoint (.ckpt file or distributed folder), a run's output_dir or an MLflow run id"
    )
    p.add_argument("out_dir", help="the Hugging Face model directory to write")
    p.add_argument("--which", choices=("last", "best"), default="last", help="a run's checkpoint (default: last)")
    p.add_argument(
        "--tracking-uri",
        help="MLflow store of the run: where a run id is found (default: ./mlruns/mlflow.db) and the export is "
        "logged (default: the run's logger.tracking_uri)",
    )
    p.add_argument("--dtype", help="weights' dtype (default: the run's model.dtype)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the directory to the run's MLflow artifacts")
    p.add_argument("--merge", action="store_true", help="a LoRA run: merge the adapters into a full model")
    p.add_argument("--overwrite", action="store_true", help="replace the model in a non-empty out_dir (keeps others)")
    sub.add_parser("env", help="the allocator and OpenMP settings the command runs with (env $(ngrpo env) python ...)")
    p = sub.add_parser("diagnose", help="semantic-drift pilot, or explorers side by side", add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("mode", nargs="?", choices=("drift", "rollouts"))
    p.add_argument("overrides", nargs="*", help="Hydra overrides: group=option or key=value")
    argv = list(sys.argv[1:] if argv is None else argv)
    modules_from_here()
    if argv[:1] == ["train"] and any(a in ("-v", "--verbose") for a in argv):  # anywhere among the overrides
        argv = [a for a in argv if a not in ("-v", "--verbose")] + ["logger.verbose=true"]
    args = parser.parse_args(argv)
    if args.command == "export":
        return _export(args)
    if args.command == "env":  # what the launcher (commands/bin/ngrpo) and launch.py set
        sys.stdout.write("".join(f"{k}={os.environ[k]}\n" for k in COMMAND_ENV if k in os.environ))
        return 0
    if args.help or (args.command == "diagnose" and args.mode is None):
        mode = " {drift,rollouts}" if args.command == "diagnose" else ""
        print(f"usage: ngrpo {args.command}{mode} [group=option ...] [key=value ...]\n")
        print_command_help(args.command)
        return 0 if args.help else 2
    try:
        if args.command == "eval":
            cfg = compose(args.overrides, "eval", model_paths=True)  # as compose_eval: its errors before torch loads
            from ngrpo_lightning.commands.eval import run_eval

            print(run_eval(cfg)["text"])
            return 0
        if args.command == "compare":
            cfg = compose(args.overrides, "compare")
            from ngrpo_lightning.commands.compare.command import run_compare

            print(run_compare(cfg)["text"])
            return 0
        if args.command == "diagnose":
            from ngrpo_lightning.commands.diagnose.command import run_diagnose

            print(run_diagnose(args.mode, args.overrides)["text"])
            return 0
        if getattr(args, "multirun", False):
            from ngrpo_lightning.commands.sweep import run_sweep
            from ngrpo_lightning.commands.train import train

            sweep = run_sweep(args.overrides, train)
            print(sweep["text"])
            return 0 if all(j["status"] == "finished" for j in sweep["jobs"]) else 1
        cfg = compose(args.overrides, allow_missing=args.command == "config")
        if args.command == "config":
            print(OmegaConf.to_yaml(cfg))
            for key in sorted(OmegaConf.missing_keys(cfg)):
                print(f"ngrpo: {key} has no value yet (???): give it to ngrpo train as {key}=...", file=sys.stderr)
            return 0
        from ngrpo_lightning.commands.train import Interrupted, train

        try:
            summary = train(cfg)
        except Interrupted as err:
            print(f"ngrpo train: {err}", file=sys.stderr)
            return err.status
    except (ConfigError, FileNotFoundError) as err:
        print(f"ngrpo: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - a full disk is one line; anything else is raised again
        return _disk_full(args.command, err)
    print(summary["text"])
    return 0


def _disk_full(command: str, err: Exception) -> int:
    """A write that found the disk full: one line and exit status 1, no traceback; anything else is raised again."""
    from ngrpo_lightning.checkpoints.disk import KEPT, DiskFull, no_space

    if not no_space(err):
        raise err
    if isinstance(err, DiskFull):  # it names the file and what was kept
        text = str(err)
    else:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        text = f"a write found the disk full: {first}." + (f" {KEPT}" if command == "train" else "")
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) == 0:  # the ranks of a sharded run fail together: one says it
        print(f"ngrpo {command}: error: {text}", file=sys.stderr)
    return 1


def _export(args) -> int:
    from ngrpo_lightning.checkpoints.export import export_checkpoint
    from ngrpo_lightning.tracking.console import quiet_libraries

    quiet_libraries()  # transformers' loading and writing bars: instant for a model on disk

    try:
        result = export_checkpoint(
            args.source,
            args.out_dir,
            which=args.which,
            tracking_uri=args.tracking_uri,
            dtype=args.dtype,
            log_to_mlflow=not args.no_mlflow,
            merge=args.merge,
            overwrite=args.overwrite,
        )
    except (ConfigError, FileNotFoundError) as err:
        print(f"ngrpo: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - a full disk is one line; anything else is raised again
        return _disk_full("export", err)
    print(result["text"])
    return 0


def modules_from_here() -> None:
    """Let a command-line class path name a module here (as ``python -m``); appended last, never shadowing a package."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)


def exit_after(code: int) -> NoReturn:
    """End the process with ``code``: the usual exit (atexit handlers, threads joined) without the garbage collector's
    slow walk over the libraries' objects (``gc.freeze()``); a caller of :func:`main` keeps its collector."""
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    exit_after(main())
