"""The ``ngrpo`` command line.

    ngrpo train [key=value ...]     train (Hydra overrides: group=option, a.b=value)
    ngrpo train --help              list the config groups and their options
    ngrpo config [key=value ...]    print the composed config and exit
    ngrpo eval [key=value ...]      pass@k evaluation (conf/eval.yaml; see docs/evaluation.md)
    ngrpo diagnose drift|rollouts [key=value ...]
                                    semantic-drift pilot / explorers side by side (docs/diagnostics.md)
    ngrpo export <checkpoint | run output_dir | MLflow run id> <out_dir>
                                    a trained policy as a Hugging Face model (docs/checkpoints.md)

Configuration is composed by Hydra from ``conf/`` (config groups: model, data, explorer,
objective, trainer, logger, experiment). Errors in the config print one clear line that
names the key and exit with status 2; nothing is trained.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from . import allocator
from .build import build_module, build_pass_at_k, build_trainer, check_config
from .build_data import build_datamodule, build_problems
from .checkpointing import check_resume, checkpoint_meta, claim_output_dir, resolve_resume
from .compare.command import compose_compare, run_compare
from .config import GROUPS, ConfigError, compose, group_options
from .console import header, quiet_libraries
from .diagnose.command import run_diagnose
from .eval_command import compose_eval, run_eval
from .export import export_checkpoint, model_card, save_hf_model
from .host_memory import apply_host_settings
from .sweep import run_sweep
from .tracking import build_logger, log_config, summarize_run


def print_groups() -> None:
    print("Config groups (select with group=option; override any key with a.b=value):")
    for g in GROUPS:
        print(f"  {g:<10} {', '.join(group_options(g))}")
    print(
        "\nExamples:\n  ngrpo train experiment=ngrpo\n  ngrpo train model=tiny trainer.max_steps=2 optim.lr=1e-5"
        "\n  ngrpo config experiment=grpo   # print the composed config"
    )


# ------------------------------------------------------------------- commands
# Lightning warnings that are expected here and would only bury the run's own output.
KNOWN_WARNINGS = (
    r"Found \d+ module\(s\) in eval mode",  # the frozen reference model, on purpose
    r"Using ModelCheckpoint with manual optimization",  # checkpoints are taken between steps
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)


def train(cfg: DictConfig, callbacks: Sequence[L.Callback] = ()) -> dict:
    """Run one training job (``ngrpo train``) on a composed config; returns a summary dict.

    ``callbacks``: more Lightning callbacks for the run's Trainer, beside those the config asks
    for: what a script adds to a run from Python (a recorder of step metrics, an early stop)::

        from ngrpo_lightning.cli import train
        from ngrpo_lightning.config import compose
        train(compose(["model=tiny", "trainer.max_steps=2"]), callbacks=[MyCallback()])
    """
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    for pattern in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    quiet_libraries(verbose=bool(cfg.logger.get("verbose", False)))
    check_config(cfg)  # every component, setting, trainer and engine is checked before any model or data loads
    if rank_zero_only.rank == 0:
        print(header(cfg), flush=True)
    apply_host_settings(cfg)
    # resume=last | path: the same run continues (weights, RNG, data position, MLflow run)
    ckpt_path = resolve_resume(cfg)
    meta = checkpoint_meta(ckpt_path) if ckpt_path else {}
    if ckpt_path:
        check_resume(cfg, meta)  # a checkpoint of another model or config: a clear error, nothing runs
    problems = build_problems(cfg.data, cfg.seed)  # data errors first: before minutes of model loading
    claim_output_dir(cfg, ckpt_path, meta)  # another run's checkpoints there: refused, or overwrite=true
    logger = build_logger(cfg, run_id=meta.get("mlflow_run_id"), monitor=True)  # so are tracking-store errors
    try:
        summary = _fit(cfg, logger, problems, ckpt_path, callbacks)
    except BaseException as err:
        if logger is not None:  # the run's status says what happened (a SIGKILL leaves it RUNNING)
            logger.close("KILLED" if isinstance(err, KeyboardInterrupt) else "failed")
        raise
    if logger is not None:
        logger.close("success")
    return summary


def _fit(cfg: DictConfig, logger, problems, ckpt_path: str | None, callbacks: Sequence[L.Callback] = ()) -> dict:
    """Validate, fit and validate again; the summary of the run."""
    module = build_module(cfg)
    datamodule = build_datamodule(cfg, module.tokenizer, problems)
    trainer = build_trainer(cfg, logger, callbacks=[*build_pass_at_k(cfg, problems[1]), *callbacks])
    module.run_meta = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "mlflow_run_id": getattr(logger, "run_id", None),
        "command": command_line(),
    }
    if logger is not None and not ckpt_path:
        log_config(logger, cfg)
    t0 = time.perf_counter()
    validate_first = cfg.validate_before_fit and datamodule.val_problems and not ckpt_path
    before = trainer.validate(module, datamodule=datamodule, verbose=False) if validate_first else None
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        after = trainer.validate(module, datamodule=datamodule, verbose=False) if datamodule.val_problems else None
    finally:
        datamodule.close()
    if not trainer.is_global_zero:  # other ranks of a multi-process run: rank 0 reports
        return {"steps": trainer.global_step, "text": "", "run_id": None}
    summary = summarize_run(trainer, logger, before, after, time.perf_counter() - t0)
    if cfg.export.final:
        exported = export_final(cfg, module, trainer, logger, after)
        summary["text"] += f"\n  exported:   {exported} (a Hugging Face model; docs/checkpoints.md)"
    return summary


def export_final(cfg: DictConfig, module, trainer, logger, after) -> Path:
    """``export.final``: the trained policy as a Hugging Face model in ``export.dir`` (default
    ``<output_dir>/hf_model``), logged to the run's MLflow artifacts (``model/``)."""
    out = Path(cfg.export.dir or Path(cfg.output_dir) / "hf_model")
    if module.parallel is not None:  # sharded weights: the checkpoint written at the end of training holds them whole
        return export_checkpoint(str(cfg.output_dir), out, log_to_mlflow=logger is not None)["out"]
    metrics = {k: float(v) for k, v in (after[0] if after else {}).items() if k.startswith("val/")}
    card = model_card(module.run_meta["config"], module.run_meta, trainer.global_step, metrics)
    save_hf_model(module.policy, module.tokenizer, out, card)
    if logger is not None:
        logger.experiment.log_artifacts(logger.run_id, str(out), "model")
    return out


def command_line() -> str:
    """The command that started this process, as a user would type it again."""
    program = Path(sys.argv[0]).name
    return shlex.join(["ngrpo" if program in ("ngrpo", "cli.py", "launch.py") else sys.argv[0], *sys.argv[1:]])


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
    p.add_argument(
        "--which", choices=("last", "best"), default="last", help="which checkpoint of a run (default: last)"
    )
    p.add_argument("--tracking-uri", help="MLflow store of the run (default: the run's logger.tracking_uri)")
    p.add_argument("--dtype", help="weights' dtype (default: the run's model.dtype)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the directory to the run's MLflow artifacts")
    p.add_argument("--merge", action="store_true", help="a LoRA run: merge the adapters into a full model")
    p = sub.add_parser("diagnose", help="semantic-drift pilot, or explorers side by side", add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("mode", nargs="?", choices=("drift", "rollouts"))
    p.add_argument("overrides", nargs="*", help="Hydra overrides: group=option or key=value")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"] and any(a in ("-v", "--verbose") for a in argv):  # anywhere among the overrides
        argv = [a for a in argv if a not in ("-v", "--verbose")] + ["logger.verbose=true"]
    args = parser.parse_args(argv)
    if args.command == "export":
        return _export(args)
    if args.help or (args.command == "diagnose" and args.mode is None):
        mode = " {drift,rollouts}" if args.command == "diagnose" else ""
        print(f"usage: ngrpo {args.command}{mode} [group=option ...] [key=value ...]\n")
        print_groups()
        return 0 if args.help else 2
    try:
        if args.command == "eval":
            cfg = compose_eval(args.overrides)
            restart_on_allocator(cfg, argv)
            print(run_eval(cfg)["text"])
            return 0
        if args.command == "compare":
            print(run_compare(compose_compare(args.overrides))["text"])
            return 0
        if args.command == "diagnose":
            print(run_diagnose(args.mode, args.overrides)["text"])
            return 0
        if getattr(args, "multirun", False):
            sweep = run_sweep(args.overrides, train)
            print(sweep["text"])
            return 0 if all(j["status"] == "finished" for j in sweep["jobs"]) else 1
        cfg = compose(args.overrides, allow_missing=args.command == "config")
        if args.command == "config":
            print(OmegaConf.to_yaml(cfg))
            for key in sorted(OmegaConf.missing_keys(cfg)):
                print(f"ngrpo: {key} has no value yet (???): give it to ngrpo train as {key}=...", file=sys.stderr)
            return 0
        restart_on_allocator(cfg, argv)
        summary = train(cfg)
    except ConfigError as err:
        print(f"ngrpo: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"ngrpo: error: {err}", file=sys.stderr)
        return 2
    print(summary["text"])
    return 0


def restart_on_allocator(cfg: DictConfig, argv: list[str]) -> None:
    """A ``host.allocator`` that a config group set (not the command line): the command restarts
    on it now (:func:`ngrpo_lightning.allocator.ensure`; a no-op from the Python API)."""
    try:
        allocator.ensure(allocator.configured(cfg), argv)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _export(args) -> int:
    try:
        result = export_checkpoint(
            args.source,
            args.out_dir,
            which=args.which,
            tracking_uri=args.tracking_uri,
            dtype=args.dtype,
            log_to_mlflow=not args.no_mlflow,
            merge=args.merge,
        )
    except (ConfigError, FileNotFoundError) as err:
        print(f"ngrpo: error: {err}", file=sys.stderr)
        return 2
    print(result["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
