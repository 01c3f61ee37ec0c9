"""``ngrpo diagnose drift|rollouts``: compose ``conf/diagnose.yaml``, load the policy, run the pilot or comparison,
write ``<mode>.md``, ``<mode>.json`` and ``<mode>.png`` into ``output_dir`` and log them to an MLflow run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ngrpo_lightning.build.components import build_explorer
from ngrpo_lightning.checks import check_number
from ngrpo_lightning.commands.diagnose.drift import run_drift, select_tokens
from ngrpo_lightning.commands.diagnose.report import drift_table, plot_drift, plot_rollouts, rollouts_table, to_jsonable
from ngrpo_lightning.commands.diagnose.rollouts import compare_explorers, mixture_weight_pool, resolve_explorers
from ngrpo_lightning.commands.eval import build_eval_sets, eval_rollouts, load_eval_policy
from ngrpo_lightning.config import ConfigError, compose
from ngrpo_lightning.data import PromptDataset
from ngrpo_lightning.rollout import HFEngine
from ngrpo_lightning.rollout.engine import special_token_ids
from ngrpo_lightning.tracking.console import quiet_libraries
from ngrpo_lightning.tracking.logger import log_report_run

MODES = ("drift", "rollouts")
WEIGHT_SOURCES = ("explorer", "uniform")


def compose_diagnose(overrides: list[str]) -> DictConfig:
    """``conf/diagnose.yaml`` with the overrides (``model=<HF id | dir>`` as for ``ngrpo eval``)."""
    return compose(overrides, "diagnose", model_paths=True)


def _check_int(cfg, key: str, minimum: int = 1) -> int:
    try:
        return check_number(key, cfg[key], minimum, integer=True)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _prompt_items(ev, tokenizer) -> list[dict]:
    """The evaluation set's prompts, rendered as ``ngrpo eval`` renders them."""
    kwargs = {
        k: v for k, v in {"instruction": ev.instruction, "system_prompt": ev.system_prompt}.items() if v is not None
    }
    return list(PromptDataset(ev.problems, tokenizer, max_prompt_tokens=ev.max_prompt_tokens, **kwargs))


def _log_run(cfg, mode: str, metrics: dict[str, float], files: list[Path], seconds: float) -> list[str]:
    """Log config, metrics and files to an MLflow run named after the mode; lines for the summary."""
    if cfg.logger.name == "mlflow" and not cfg.logger.get("run_name"):
        cfg.logger.run_name = mode
    return log_report_run(cfg, {**metrics, f"{mode}/seconds": seconds}, files)[1]


def _write_outputs(cfg, mode: str, table: str, payload: dict) -> dict[str, Path]:
    """Write the mode's table and its JSON (the config, then ``payload``) to ``output_dir``; their paths and the
    plot's (``<mode>.md``, ``.json``, ``.png``), which the caller draws."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"table": out / f"{mode}.md", "json": out / f"{mode}.json", "plot": out / f"{mode}.png"}
    paths["table"].write_text(table)
    payload = {"config": OmegaConf.to_container(cfg, resolve=True), **payload}
    paths["json"].write_text(json.dumps(to_jsonable(payload), indent=1, ensure_ascii=False))
    return paths


def _summary(cfg, mode: str, head: list[str], table: str, paths: dict, metrics: dict, seconds: float, **fields) -> dict:
    """Log the run (:func:`_log_run`) and return the mode's summary: ``fields``, the table, paths and ``text``
    (``head``'s lines, the table, the paths and the run's lines)."""
    lines = [*head, "", table] + [f"  {key}: {p}" for key, p in paths.items()]
    lines += _log_run(cfg, mode, metrics, list(paths.values()), seconds)
    paths = {key: str(p) for key, p in paths.items()}
    return {**fields, "seconds": seconds, "table": table, "paths": paths, "text": "\n".join(lines)}


# --------------------------------------------------------------------- drift
def weight_pool(cfg, policy, tokenizer, k: int) -> tuple[torch.Tensor, str]:
    """The mixture weights of the pilot and a line saying where they come from. ``weights=explorer``: the weights
    ``NeighborMixingExplorer`` (with this ``k`` and ``metric``) recorded at its mixed steps in rollouts of the first
    ``weight_prompts`` prompts, reused for every pilot token (a token-level pilot has no context of its own).
    ``weights=uniform``: ``1/k`` each, the largest displacement mixing can make."""
    if cfg.weights == "uniform":
        return torch.full((1, k), 1.0 / k), f"uniform weights 1/{k}"
    if cfg.weights != "explorer":
        raise ConfigError(f"weights={cfg.weights!r} is unknown: allowed {list(WEIGHT_SOURCES)}")
    prompts, _ = _check_int(cfg, "weight_prompts"), _check_int(cfg, "G")
    (ev,) = build_eval_sets(cfg)
    ev.problems = ev.problems[:prompts]
    explorer_cfg = {**resolve_explorers(["neighbor"])[0][1], "k": k, "metric": cfg.metric}
    explorer = build_explorer(explorer_cfg)
    engine = HFEngine(policy, tokenizer, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    try:
        pool = mixture_weight_pool(
            engine, [it["prompt_ids"] for it in _prompt_items(ev, tokenizer)], explorer, cfg.G, cfg.max_new_tokens
        )
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return pool, (
        f"{len(pool)} weight vectors the neighbor explorer (k={k}, rho={explorer.rho:g}, T={explorer.temperature:g}) "
        f"drew in {len(ev.problems)} prompts x {cfg.G} rollouts; mean anchor weight {pool[:, 0].mean():.3f}"
    )


def run_drift_command(cfg) -> dict:
    """``ngrpo diagnose drift``: returns a summary with a ``text`` field."""

    k, n = _check_int(cfg, "k"), _check_int(cfg, "n")
    scales = [float(s) for s in cfg.scales]
    if cfg.pca_scale not in scales:
        raise ConfigError(f"pca_scale={cfg.pca_scale!r} must be one of scales={scales}")
    if cfg.weights not in WEIGHT_SOURCES:
        raise ConfigError(f"weights={cfg.weights!r} is unknown: allowed {list(WEIGHT_SOURCES)}")
    tokens = None if cfg.tokens is None else list(cfg.tokens) if OmegaConf.is_list(cfg.tokens) else [cfg.tokens]
    policy, tokenizer = load_eval_policy(cfg)
    embeddings = policy.get_input_embeddings().weight.detach()
    exclude = special_token_ids(tokenizer, embeddings.shape[0])
    try:
        ids, labels = select_tokens(tokenizer, tokens, exclude)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    t0 = time.perf_counter()
    pool, pool_text = weight_pool(cfg, policy, tokenizer, k)
    label = lambda i: tokenizer.decode([i])  # noqa: E731
    try:
        result = run_drift(
            embeddings,
            ids,
            pool,
            scales,
            n=n,
            k=k,
            metric=cfg.metric,
            exclude_ids=exclude,
            seed=cfg.seed,
            label=label,
            num_examples=cfg.examples,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from err
    seconds = time.perf_counter() - t0
    table = drift_table(result["rows"], k)
    payload = {
        "seconds": seconds,
        "weights": pool_text,
        "weight_pool": {"size": len(pool), "mean": pool.mean(0)},
        "tokens": [{"id": i, "text": t} for i, t in zip(ids, labels)],
        "rows": result["rows"],
        "neighborhoods": [
            {"id": a, "token": label(a), "neighborhood": [label(i) for i in hood]}
            for a, hood in result["neighborhoods"].items()
        ],
    }
    paths = _write_outputs(cfg, "drift", table, payload)
    plot_drift(
        result,
        labels,
        paths["plot"],
        pca_key=f"gaussian@{cfg.pca_scale:g}",
        title=f"{cfg.model.name_or_path}: {len(ids)} tokens x {n} draws; k={k}, {cfg.weights} weights",
    )
    metrics = {
        f"drift/{r['method']}" + (f"_{r['scale']:g}" if r["method"] == "gaussian" else "") + f"/{key}": r[key]
        for r in result["rows"]
        for key in ("same_frac", "neighborhood_frac", "cosine", "nearest_cosine", "rel_norm")
    }
    head = [
        f"Drift pilot on {cfg.model.name_or_path}: {len(ids)} tokens x {n} draws per method in {seconds:.1f} s.",
        f"  mixture weights: {pool_text}",
    ]
    return _summary(cfg, "drift", head, table, paths, metrics, seconds, result=result)


# ------------------------------------------------------------------ rollouts
def run_rollouts_command(cfg) -> dict:
    """``ngrpo diagnose rollouts``: returns a summary with a ``text`` field."""

    G, max_new = _check_int(cfg, "G"), _check_int(cfg, "max_new_tokens")
    batch_size = _check_int(cfg, "batch_size")
    names = list(cfg.explorers) if OmegaConf.is_list(cfg.explorers) else cfg.explorers
    args = OmegaConf.to_container(cfg.explorer_args, resolve=True) if cfg.get("explorer_args") else {}
    explorers = []
    for name, c in resolve_explorers(names, args):  # errors before model loading
        try:
            explorers.append((name, build_explorer(c)))
        except ConfigError as err:
            raise ConfigError(f"explorers: {name}: {err}") from err
    (ev,) = build_eval_sets(cfg)
    policy, tokenizer = load_eval_policy(cfg)
    items = _prompt_items(ev, tokenizer)
    t0 = time.perf_counter()
    with eval_rollouts(cfg, policy, tokenizer, max_new) as (engine, rewards):
        results = compare_explorers(
            lambda: _reseeded(engine, cfg.seed), items, explorers, G, max_new, rewards(ev.answer_format), batch_size
        )
    seconds = time.perf_counter() - t0
    table = rollouts_table(results, G)
    payload = {
        "seconds": seconds,
        "set": ev.name,
        "explorers": {name: repr(e) for name, e in explorers},
        "results": results,
    }
    paths = _write_outputs(cfg, "rollouts", table, payload)
    plot_rollouts(
        results,
        G,
        paths["plot"],
        title=f"{cfg.model.name_or_path} on {ev.name}: {len(items)} prompts x G={G}, at most {max_new} new tokens",
    )
    metrics = {f"rollouts/{name}/{key}": v for name, res in results.items() for key, v in res["metrics"].items()}
    head = [
        f"Rolled out {len(items)} prompts of {ev.name} x G={G} with {len(explorers)} explorers on "
        f"{cfg.model.name_or_path} in {seconds:.1f} s."
    ]
    return _summary(cfg, "rollouts", head, table, paths, metrics, seconds, results=results)


def run_diagnose(mode: str, overrides: list[str]) -> dict:
    """Compose the config and run one mode (``drift`` or ``rollouts``)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

    if mode not in MODES:
        raise ConfigError(f"diagnose mode {mode!r} is unknown: allowed {list(MODES)}")
    cfg = compose_diagnose(overrides)
    quiet_libraries(verbose=bool((cfg.get("logger") or {}).get("verbose", False)))
    torch.manual_seed(cfg.seed)
    return run_drift_command(cfg) if mode == "drift" else run_rollouts_command(cfg)


def _reseeded(engine, seed: int):
    """The engine with its sampling generator reset to ``seed``: every explorer starts from the same random state."""
    engine.load_state_dict({"seed": seed, "generator": None})
    return engine
