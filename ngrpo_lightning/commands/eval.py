"""``ngrpo eval``: compose the evaluation config, load the policy (HF id, folder or Lightning checkpoint), sample and
score the sets with :mod:`ngrpo_lightning.metrics.evaluate`, and write the table, plot, JSON and MLflow run."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from ngrpo_lightning.backends import Backend
from ngrpo_lightning.build.models import backend_for_config
from ngrpo_lightning.checkpoints.export import exported_data_seed
from ngrpo_lightning.checkpoints.trained_policy import (
    find_checkpoint,
    is_run_checkpoint,
    load_trained_policy,
    read_checkpoint,
)
from ngrpo_lightning.checks import check_choice, check_seed
from ngrpo_lightning.config import ConfigError, compose
from ngrpo_lightning.data import load_problems, reasoning_gym_problems
from ngrpo_lightning.data.benchmarks import load_benchmark
from ngrpo_lightning.explorers import TemperatureExplorer
from ngrpo_lightning.metrics.evaluate import (
    EvalSet,
    RewardCache,
    check_ks,
    evaluate_sets,
    plot_pass_at_k,
    results_table,
)
from ngrpo_lightning.models.loading import check_context, load_policy
from ngrpo_lightning.rollout import build_engine
from ngrpo_lightning.rollout.engine import full_named_tensors
from ngrpo_lightning.tracking.console import quiet_libraries
from ngrpo_lightning.tracking.logger import log_report_run


def compose_eval(overrides: list[str]) -> DictConfig:
    """``conf/eval.yaml`` with the overrides; ``model=<HF id | directory | file.ckpt>`` takes any model."""
    return compose(overrides, "eval", model_paths=True)


def build_eval_sets(cfg) -> list[EvalSet]:
    """The evaluation set of ``cfg.data``: a benchmark, reasoning-gym tasks' validation split (the
    default), or files (``data.val``, else ``data.train``); ``limit`` keeps the first problems."""
    d, limit = cfg.data, cfg.get("limit")
    common = {
        "instruction": d.get("instruction"),
        "system_prompt": d.get("system_prompt"),
        "answer_format": d.get("answer_format", "boxed"),
        "max_prompt_tokens": d.get("max_prompt_tokens", 4096),
    }
    try:
        if d.source == "reasoning_gym":
            seed = cfg.seed if cfg.seed is not None else 0  # run_eval resolves null first (eval_seed)
            problems = reasoning_gym_problems(d.tasks, d.val_size, seed, "validation", d.verifier)
            name = "reasoning_gym"
        elif d.source == "benchmark":
            problems, name = load_benchmark(d), d.name
        elif d.source == "files":
            source = d.val or d.train
            problems = load_problems(
                source,
                problem_field=d.problem_field,
                answer_field=d.answer_field,
                split=d.val_split if d.val else d.split,
                id_field=d.id_field,
            )
            name = d.get("name") or Path(str(source)).stem
        else:
            allowed = ["benchmark", "files", "reasoning_gym"]
            raise ConfigError(f"data.source={d.source!r} is unknown: allowed {allowed}")
    except (ValueError, KeyError) as err:
        raise ConfigError(str(err).strip('"')) from err
    if limit is not None:
        problems = problems[: int(limit)]
    if not problems:
        raise ConfigError(f"evaluation set {name!r} has no problems")
    return [EvalSet(name, problems, **common)]


def build_eval_engine(cfg, policy, tokenizer, max_new_tokens: int):
    """The rollout engine of ``engine=<name>`` evaluating ``policy``, seeded with ``seed`` (vLLM gets its weights)."""
    try:
        engine = build_engine(
            cfg.get("engine", "hf"),
            policy,
            tokenizer,
            max_new_tokens=max_new_tokens,
            seed=cfg.seed if cfg.seed is not None else 0,
            key="engine",
            max_prompt_tokens=cfg.data.get("max_prompt_tokens", 4096),
        )
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if engine.needs_sync:
        engine.sync_weights(full_named_tensors(policy))
    return engine


@contextmanager
def eval_rollouts(cfg, policy, tokenizer, max_new_tokens: int):
    """``(engine, rewards)`` for sampling and scoring an evaluation; both closed on exit."""
    engine = build_eval_engine(cfg, policy, tokenizer, max_new_tokens)
    rewards = RewardCache(timeout_s=cfg.reward.timeout_s, num_workers=cfg.reward.num_workers)
    try:
        yield engine, rewards
    finally:
        rewards.close()
        engine.close()


def eval_device(cfg) -> str:
    """``device``: ``cpu``, ``cuda``, or ``auto`` (a CUDA GPU where there is one), checked before any model loads."""
    device = cfg.get("device", "cpu")
    try:
        check_choice("device", device, ["auto", "cpu", "cuda"])
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but this machine has no CUDA GPU: use device=cpu (or device=auto)")
    return device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"


def eval_backend(cfg) -> Backend:
    """How the evaluated model computes (``backend.*``, on ``device``), checked."""
    rows = (cfg.get("batch_size") or 8) * (cfg.get("n") or 1)
    return backend_for_config(cfg, eval_device(cfg), decode_rows=rows)


def load_eval_policy(cfg, backend: Backend | None = None):
    """``(model, tokenizer)``: ``model.name_or_path`` (HF id, directory, built-in name), or a trained run's policy (a
    checkpoint; an ``output_dir``'s ``last.ckpt``, ``best.ckpt`` with ``checkpoint=best``) in the base model the run
    recorded, or ``checkpoint=<path>`` in ``model.name_or_path``; the backend (default: the config's) swaps modules."""
    backend = backend or eval_backend(cfg)
    name, dtype = str(cfg.model.name_or_path), cfg.model.dtype
    source, which = checkpoint_source(cfg)
    base = None if source == name else name
    if source is None:
        policy, tokenizer = load_policy(
            name,
            dtype=dtype,
            trust_remote_code=cfg.model.trust_remote_code,
            attn_implementation=backend.attention,
        )
    else:
        path = find_checkpoint(str(source), which)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint not found: {path}")
        ckpt = read_checkpoint(path)
        remote = {"trust_remote_code": True} if cfg.model.trust_remote_code else {}
        policy, tokenizer = load_trained_policy(
            ckpt,
            base=base,
            dtype=None if base is None else dtype,
            attn_implementation=backend.attention,
            **remote,
            action="eval",
        )
    check_context(
        policy,
        ("data.max_prompt_tokens", cfg.data.get("max_prompt_tokens", 4096)),
        ("max_new_tokens", cfg.max_new_tokens),
    )
    return backend.on_device(backend.prepare(policy.to(eval_device(cfg)).eval())), tokenizer


def checkpoint_source(cfg) -> tuple[str | None, str]:
    """``(source, which)``: the trained run evaluated (None for a plain model) and ``last`` or ``best``."""
    name, ckpt_arg = str(cfg.model.name_or_path), cfg.get("checkpoint")
    source = ckpt_arg if ckpt_arg not in (None, "best", "last") else name if is_run_checkpoint(name) else None
    return source, "best" if ckpt_arg == "best" else "last"


def eval_seed(cfg) -> tuple[int, str]:
    """``(seed, where it came from)``: ``seed=``; else the data seed of the run that trained the model (checkpoint
    config or export model card), so its validation problems are evaluated; else 0."""
    if cfg.get("seed") is not None:
        try:
            return check_seed(cfg.seed), "seed="
        except ValueError as err:
            raise ConfigError(str(err)) from err
    name = str(cfg.model.name_or_path)
    source, which = checkpoint_source(cfg)
    if source is not None:
        seed = read_checkpoint(find_checkpoint(str(source), which)).config.get("seed")
        if isinstance(seed, int):
            return seed, "the run's"
    elif (seed := exported_data_seed(name)) is not None:
        return seed, "the run's, from its export's model card"
    return 0, "default"


def eval_header(cfg, seed: tuple[int, str]) -> str:
    """What ``ngrpo eval`` is about to do, said before minutes of loading and sampling."""
    d = cfg.data
    data = d.get("name") or d.source
    limit = f", the first {cfg.limit} problems" if cfg.get("limit") is not None else ""
    where = f"{eval_device(cfg)}, {torch.get_num_threads()} threads"
    return "\n".join(
        [
            f"ngrpo eval: {cfg.model.name_or_path}"
            + (f" (checkpoint={cfg.checkpoint})" if cfg.get("checkpoint") else ""),
            f"  data:     {data}{limit}; {cfg.n} samples per problem at T={cfg.temperature:g}, "
            f"at most {cfg.max_new_tokens} new tokens",
            f"  seed:     {seed[0]} ({seed[1]}; seed=<n> evaluates another draw)",
            f"  device:   {where}, engine {cfg.get('engine', 'hf')}",
        ]
    )


def run_eval(cfg) -> dict:
    """``ngrpo eval``: evaluate, write ``results.json``, ``pass_at_k.md`` and ``pass_at_k.png`` into
    ``output_dir``, log them to an MLflow run; returns a summary with a ``text`` field."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    quiet_libraries(verbose=bool((cfg.get("logger") or {}).get("verbose", False)))
    seed = eval_seed(cfg)
    cfg.seed = seed[0]  # the problems and the sampling: the run's draw, where the model came from a run
    print(eval_header(cfg, seed), flush=True)
    try:
        L.seed_everything(check_seed(cfg.seed), workers=True, verbose=False)
        ks = check_ks(cfg.get("ks"), cfg.n)
        explorer = TemperatureExplorer(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    except ValueError as err:  # the sampling settings are eval's own keys, not an explorer's
        raise ConfigError(str(err).removeprefix("explorer.")) from err
    backend = eval_backend(cfg)
    sets = build_eval_sets(cfg)  # data errors before minutes of model loading
    policy, tokenizer = load_eval_policy(cfg, backend)
    dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
    t0 = time.perf_counter()
    bar = tqdm(total=sum(len(s.problems) for s in sets), desc="eval", unit="problem", dynamic_ncols=True)
    done = {}

    def progress(name: str, finished: int, total: int) -> None:  # problems finished in each set
        bar.update(finished - done.get(name, 0))
        done[name] = finished

    with eval_rollouts(cfg, policy, tokenizer, cfg.max_new_tokens) as (engine, rewards), bar:
        results = evaluate_sets(
            engine,
            tokenizer,
            sets,
            explorer,
            n=cfg.n,
            max_new_tokens=cfg.max_new_tokens,
            rewards=rewards,
            batch_size=cfg.batch_size,
            ks=ks,
            prefix="eval",
            progress=progress,
        )
    seconds = time.perf_counter() - t0
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = OmegaConf.to_container(cfg, resolve=True)
    config["model"]["dtype"] = dtype  # what the model computed in (a checkpoint's own dtype)
    payload = {"config": config, "seconds": seconds, **results}
    json_path, table_path, plot_path = out_dir / "results.json", out_dir / "pass_at_k.md", out_dir / "pass_at_k.png"
    json_path.write_text(json.dumps(payload, indent=1))
    table = results_table(results)
    table_path.write_text(table)
    plot_pass_at_k(results, plot_path, title=f"{cfg.model.name_or_path}: pass@k (n={cfg.n}, T={cfg.temperature:g})")
    run_id, run_lines = log_report_run(
        cfg, {**results["metrics"], "eval/seconds": seconds}, [json_path, table_path, plot_path]
    )
    lines = [
        f"Evaluated {cfg.model.name_or_path} ({dtype}) on {', '.join(s.name for s in sets)} "
        f"({sum(len(s.problems) for s in sets)} problems x {cfg.n} samples, seed {seed[0]}: {seed[1]}) "
        f"in {seconds:.1f} s.",
        "",
        table,
        f"  results: {json_path}",
        f"  table:   {table_path}",
        f"  plot:    {plot_path}",
    ]
    lines += run_lines
    return {
        "results": results,
        "seconds": seconds,
        "run_id": run_id,
        "table": table,
        "paths": {"json": str(json_path), "table": str(table_path), "plot": str(plot_path)},
        "text": "\n".join(lines),
    }
