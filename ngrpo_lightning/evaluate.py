"""Pass@k evaluation of a policy on benchmark sets: the shared core of ``callbacks.PassAtK``
and of the standalone ``ngrpo eval`` command.

Each problem is sampled ``n`` times with plain sampling (a ``TemperatureExplorer``: neighbor
mixing or any other exploration is never used at evaluation), every sample is scored by the
math reward, and per problem ``(n, c, extracted answers)`` go into a
:class:`~ngrpo_lightning.metrics.PassAtK` metric (reduced across processes). Outputs:

* metrics ``<prefix>/<set>/pass@k`` (k = 1, 2, 4, ... up to n), ``<prefix>/<set>/mean@n``,
  ``<prefix>/<set>/maj@n`` and their averages over sets, ``<prefix>/avg/...``;
* a markdown table in the paper's layout (rows: sets + average; columns: Mean@n, Pass@k);
* a pass@k-vs-k plot (PNG);
* for ``ngrpo eval``: a JSON file with every problem's n, c and answers, and an MLflow run.

MLflow metric names cannot contain ``@``: there ``pass@4`` is logged as ``pass_at_4``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .metrics.pass_at_k import PassAtK, powers_of_two


@dataclass
class EvalSet:
    """One evaluation set: its problems and how to prompt and score them."""

    name: str
    problems: list
    instruction: str | None = None  # None: the default \\boxed{} instruction
    system_prompt: str | None = None
    answer_format: str = "boxed"  # reward.extract
    max_prompt_tokens: int = 4096


def as_eval_sets(datasets) -> list[EvalSet]:
    """``{name: problems}``, a list of :class:`EvalSet` or a plain list of problems (``val``)."""
    if isinstance(datasets, EvalSet):
        return [datasets]
    if isinstance(datasets, Mapping):
        return [d if isinstance(d, EvalSet) else EvalSet(str(name), list(d)) for name, d in datasets.items()]
    datasets = list(datasets)
    if datasets and all(isinstance(d, EvalSet) for d in datasets):
        return datasets
    return [EvalSet("val", datasets)]


def mlflow_key(name: str) -> str:
    """A metric name MLflow accepts (``pass@4`` -> ``pass_at_4``)."""
    return name.replace("@", "_at_")


def check_ks(ks: Sequence[int] | None, n: int) -> list[int]:
    """The k of pass@k: ``ks`` (each 1 <= k <= n) or the powers of two up to ``n``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (samples per problem) must be a positive integer, got {n!r}")
    if ks is None:
        return powers_of_two(n)
    ks = [int(k) for k in ks]
    bad = [k for k in ks if k < 1 or k > n]
    if bad:
        raise ValueError(f"pass@k needs 1 <= k <= n: k={bad[0]} with n={n} samples per problem (raise n or drop k={bad[0]})")
    return sorted(set(ks))


# ---------------------------------------------------------------- the core
class RewardCache:
    """One reward function per answer format; ``default`` (e.g. the training module's
    reward) serves the format it was built for. Rewards created here are closed by :meth:`close`."""

    def __init__(self, default=None, timeout_s: float = 2.0, num_workers: int | None = None):
        self.default, self.timeout_s, self.num_workers = default, timeout_s, num_workers
        self.created: dict[str, object] = {}

    def __call__(self, answer_format: str):
        if self.default is not None and getattr(self.default, "extract", answer_format) == answer_format:
            return self.default
        if answer_format not in self.created:
            from .rewards import MathReward

            self.created[answer_format] = MathReward(extract=answer_format, timeout_s=self.timeout_s,
                                                     num_workers=self.num_workers)
        return self.created[answer_format]

    def close(self) -> None:
        for reward in self.created.values():
            reward.close()
        self.created.clear()


def evaluate_sets(engine, tokenizer, datasets, explorer, n: int, max_new_tokens: int, rewards: Callable | RewardCache,
                  batch_size: int = 8, ks: Sequence[int] | None = None, prefix: str = "val", rank: int = 0,
                  world_size: int = 1, prompt_defaults: Mapping | None = None, progress: Callable | None = None,
                  device: torch.device | str | None = None) -> dict:
    """Sample every problem ``n`` times and score it; returns ``{"metrics": {...}, "sets":
    {name: {"metrics", "problems": [{id, answer, n, c, answers, status}]}}, "ks", "n"}``.

    With ``world_size > 1`` each process evaluates every ``world_size``-th problem (from
    ``rank``); the metrics are reduced over all processes (all must call this; the metric's
    states live on ``device``, which must suit the process group's backend), the
    per-problem records are this process's only.
    """
    from .data import PromptDataset

    ks = check_ks(ks, n)
    if not isinstance(rewards, RewardCache):
        rewards = RewardCache(default=rewards)
    out = {"n": n, "ks": ks, "sets": {}, "metrics": {}}
    for ev in as_eval_sets(datasets):
        kwargs = {k: v for k, v in (prompt_defaults or {}).items() if v is not None}
        kwargs.update({k: v for k, v in {"instruction": ev.instruction, "system_prompt": ev.system_prompt}.items() if v is not None})
        prompts = PromptDataset(ev.problems[rank::world_size], tokenizer, max_prompt_tokens=ev.max_prompt_tokens, **kwargs)
        reward = rewards(ev.answer_format)
        metric = PassAtK(ks=ks, sync_on_compute=world_size > 1).to(device or "cpu")
        records = []
        # Every process makes the same number of generate calls (an FSDP engine gathers the
        # weights in each): shares differ by at most one problem, so the shorter ones end with a
        # padding prompt whose samples are not scored.
        share = -(-len(ev.problems) // world_size)
        for start in range(0, share, batch_size):
            items = [prompts[i] for i in range(start, min(start + batch_size, len(prompts)))]
            if not items:
                if world_size == 1:
                    break
                if len(prompts) == 0:
                    raise ValueError(f"evaluation set {ev.name!r}: process {rank} has no prompts to evaluate")
                engine.generate([prompts[0]["prompt_ids"]], explorer, n=1, max_new_tokens=max_new_tokens)
                continue
            batch = engine.generate([it["prompt_ids"] for it in items], explorer, n=n, max_new_tokens=max_new_tokens)
            golds = [it["answer"] for it in items for _ in range(n)]
            scored = reward(batch.response_text, golds)
            correct = (scored.scores > 0.5).view(len(items), n)
            answers = list(scored.answers) if scored.answers else [None] * len(golds)
            grouped = [answers[i * n:(i + 1) * n] for i in range(len(items))]
            metric.update(correct, grouped)
            for i, it in enumerate(items):
                records.append({"id": it["id"], "answer": it["answer"], "n": n, "c": int(correct[i].sum()),
                                "answers": grouped[i], "status": list(scored.status[i * n:(i + 1) * n])})
            if progress is not None:
                progress(ev.name, min(start + batch_size, len(prompts)), len(prompts))
        if world_size == 1 and not records:
            raise ValueError(f"evaluation set {ev.name!r} has no problems")
        values = {k: float(v) for k, v in metric.compute().items()}
        out["sets"][ev.name] = {"metrics": values, "problems": records}
        out["metrics"].update({f"{prefix}/{ev.name}/{k}": v for k, v in values.items()})
    names = list(out["sets"])
    shared = [k for k in out["sets"][names[0]]["metrics"] if all(k in out["sets"][s]["metrics"] for s in names)] if names else []
    out["average"] = {k: sum(out["sets"][s]["metrics"][k] for s in names) / len(names) for k in shared}
    out["metrics"].update({f"{prefix}/avg/{k}": v for k, v in out["average"].items()})
    return out


# ---------------------------------------------------------- tables and plots
def results_table(results: dict, percent: bool = True) -> str:
    """Markdown table: rows = sets + Average; columns = Mean@n, Pass@k (paper layout)."""
    n, ks = results["n"], results["ks"]
    cols = [f"mean@{n}"] + [f"pass@{k}" for k in ks]
    head = ["Dataset", f"Mean@{n}"] + [f"Pass@{k}" for k in ks]
    fmt = (lambda v: f"{100 * v:.1f}") if percent else (lambda v: f"{v:.3f}")  # noqa: E731
    cell = lambda m, c: fmt(m[c]) if c in m and not math.isnan(m[c]) else "-"  # noqa: E731
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for name, res in results["sets"].items():
        lines.append("| " + " | ".join([name] + [cell(res["metrics"], c) for c in cols]) + " |")
    if len(results["sets"]) > 1 or not results["sets"]:
        lines.append("| " + " | ".join(["**Average**"] + [cell(results["average"], c) for c in cols]) + " |")
    return "\n".join(lines) + "\n"


def plot_pass_at_k(results: dict, path: str | os.PathLike, title: str | None = None) -> Path:
    """Save a pass@k-vs-k plot (one line per set, the average dashed) as PNG."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 4), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    ks = results["ks"]
    for name, res in results["sets"].items():
        ax.plot(ks, [100 * res["metrics"][f"pass@{k}"] for k in ks], marker="o", label=name)
    if len(results["sets"]) > 1:
        ax.plot(ks, [100 * results["average"][f"pass@{k}"] for k in ks], "k--", marker="s", label="average")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title or f"pass@k ({results['n']} samples per problem)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def log_artifacts(logger, results: dict, artifact_dir: str, local_dir: str | os.PathLike | None = None) -> list[str]:
    """Log the table (markdown) and the plot (PNG) to the logger's MLflow run under
    ``artifact_dir``; no-op (empty list) for other loggers."""
    from lightning.pytorch.loggers import MLFlowLogger

    if not isinstance(logger, MLFlowLogger):
        return []
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(local_dir) if local_dir is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        table, plot = folder / "pass_at_k.md", folder / "pass_at_k.png"
        table.write_text(results_table(results))
        plot_pass_at_k(results, plot)
        for f in (table, plot):
            logger.experiment.log_artifact(logger.run_id, str(f), artifact_path=artifact_dir)
    return [f"{artifact_dir}/{table.name}", f"{artifact_dir}/{plot.name}"]


# ------------------------------------------------------------ ngrpo eval
_EVAL_GROUPS = ("model", "data", "logger")


def normalize_eval_overrides(overrides: list[str]) -> list[str]:
    """``model=<HF id | directory | file.ckpt>`` (anything that is not a ``conf/model``
    option) becomes ``model=hf model.name_or_path=<value>``."""
    from .cli import group_options

    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "model" and value and value not in group_options("model"):
            out += ["model=hf", f"model.name_or_path={value}"]
        else:
            out.append(o)
    return out


def compose_eval(overrides: list[str]):
    """Compose ``conf/eval.yaml`` with its groups (model, data, logger) and the overrides."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .build import ConfigError
    from .cli import config_dir

    overrides = normalize_eval_overrides(overrides)
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = hydra_compose(config_name="eval", overrides=overrides)
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        msg = str(err).strip().splitlines()[0]
        try:  # list the valid keys where an unknown key was given
            import re

            m = re.search(r"Could not override '([^']+)'", str(err)) or re.search(r"Key '([^']+)' is not in struct", str(err))
            if m:
                with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
                    base = hydra_compose(config_name="eval", overrides=[o for o in overrides if o.split("=", 1)[0] in _EVAL_GROUPS])
                parent = m.group(1).rsplit(".", 1)[0] if "." in m.group(1) else ""
                node = OmegaConf.select(base, parent) if parent else base
                msg = f"unknown config key {m.group(1)!r}; valid keys{' of ' + parent if parent else ''}: {sorted(node.keys())}"
        except Exception:  # keep Hydra's message
            pass
        raise ConfigError(msg) from err
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"config key {missing[0]} has no value: set it on the command line, e.g. {missing[0]}=...")
    return cfg


def build_eval_sets(cfg) -> list[EvalSet]:
    """The evaluation set of ``cfg.data``: a benchmark, the built-in task's validation split,
    or files (``data.val``, else ``data.train``); ``limit`` keeps the first problems."""
    from .build import ConfigError
    from .data import ArithmeticTask, load_problems

    d, limit = cfg.data, cfg.get("limit")
    common = {"instruction": d.get("instruction"), "system_prompt": d.get("system_prompt"),
              "answer_format": d.get("answer_format", "boxed"), "max_prompt_tokens": d.get("max_prompt_tokens", 4096)}
    try:
        if d.source == "arithmetic":
            knobs = {k: d[k] for k in ("min_operand", "max_operand", "min_ops", "max_ops")}
            problems = ArithmeticTask(num_problems=d.val_size, seed=cfg.seed, split="validation",
                                      operators=tuple(d.operators), **knobs).problems()
            name = "arithmetic"
        elif d.source == "benchmark":
            from .data.benchmarks import load_benchmark

            problems, name = load_benchmark(d), d.name
        elif d.source == "files":
            source = d.val or d.train
            problems = load_problems(source, problem_field=d.problem_field, answer_field=d.answer_field,
                                     split=d.val_split if d.val else d.split, id_field=d.id_field)
            name = d.get("name") or Path(str(source)).stem
        else:
            raise ConfigError(f"data.source={d.source!r} is unknown: allowed ['arithmetic', 'benchmark', 'files']")
    except (ValueError, KeyError) as err:
        raise ConfigError(str(err).strip('"')) from err
    if limit is not None:
        problems = problems[:int(limit)]
    if not problems:
        raise ConfigError(f"evaluation set {name!r} has no problems")
    return [EvalSet(name, problems, **common)]


def load_eval_policy(cfg):
    """``(model, tokenizer)``: ``model.name_or_path`` (HF id, directory, built-in name), with
    the policy weights of a Lightning checkpoint (``checkpoint=``, or a ``.ckpt`` as
    ``model.name_or_path``) loaded into it. A checkpoint given alone must name its base model
    in its hyper-parameters or config (``model.name_or_path``)."""
    from .build import ConfigError
    from .models import load_policy, parse_dtype

    name, ckpt_path, dtype = str(cfg.model.name_or_path), cfg.get("checkpoint"), cfg.model.dtype
    if name.endswith(".ckpt"):
        ckpt_path, name = name, None
    try:
        parse_dtype(dtype)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    state = None
    if ckpt_path:
        if not Path(ckpt_path).is_file():
            raise FileNotFoundError(f"checkpoint not found: {ckpt_path}")
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if name is None:  # the checkpoint alone: its base model, in the dtype of its weights
            name = _base_model_of(state)
            floats = [v.dtype for v in state.get("state_dict", {}).values() if torch.is_tensor(v) and v.is_floating_point()]
            dtype = str(floats[0]).removeprefix("torch.") if floats else dtype
        if not name:
            raise ConfigError(f"checkpoint {ckpt_path} does not name its base model: pass "
                              f"model.name_or_path=<base model> checkpoint={ckpt_path}")
    policy, tokenizer = load_policy(name, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code)
    if state is not None:
        weights = {k[len("policy."):]: v for k, v in state.get("state_dict", {}).items() if k.startswith("policy.")}
        if not weights:
            raise ConfigError(f"checkpoint {ckpt_path} has no policy.* weights in its state_dict")
        missing, unexpected = policy.load_state_dict(weights, strict=False)
        tied = set(getattr(policy, "_tied_weights_keys", None) or [])
        missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
        if missing or unexpected:
            raise ConfigError(f"checkpoint {ckpt_path} does not match model {name!r}: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    device = cfg.get("device", "cpu")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return policy.to(device).eval(), tokenizer


def _base_model_of(checkpoint: dict) -> str | None:
    """``model.name_or_path`` from a checkpoint's hyper-parameters or saved config."""
    for key in ("hyper_parameters", "config", "cfg"):
        node = checkpoint.get(key)
        found = _find(node, ("model", "name_or_path")) or _find(node, ("name_or_path",))
        if found:
            return str(found)
    return None


def _find(node, path):
    if node is None:
        return None
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            node = OmegaConf.to_container(node, resolve=True)
    except ImportError:
        pass
    if isinstance(node, Mapping):
        cur = node
        for p in path:
            cur = cur.get(p) if isinstance(cur, Mapping) else None
        if isinstance(cur, str):
            return cur
        for value in node.values():
            found = _find(value, path)
            if found:
                return found
    return None


def run_eval(cfg) -> dict:
    """``ngrpo eval``: evaluate, write ``results.json``, ``pass_at_k.md`` and ``pass_at_k.png``
    into ``output_dir``, log them and the metrics to an MLflow run; returns a summary with
    a ``text`` field."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import lightning as L
    from omegaconf import OmegaConf

    from .build import ConfigError, build_logger
    from .explorers import TemperatureExplorer
    from .rollout import HFEngine
    from .tracking import flatten

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    try:
        ks = check_ks(cfg.get("ks"), cfg.n)
        explorer = TemperatureExplorer(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    sets = build_eval_sets(cfg)  # data errors before minutes of model loading
    policy, tokenizer = load_eval_policy(cfg)
    engine = HFEngine(policy, tokenizer, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    rewards = RewardCache(timeout_s=cfg.reward.timeout_s, num_workers=cfg.reward.num_workers)
    t0 = time.perf_counter()
    try:
        results = evaluate_sets(engine, tokenizer, sets, explorer, n=cfg.n, max_new_tokens=cfg.max_new_tokens,
                                rewards=rewards, batch_size=cfg.batch_size, ks=ks, prefix="eval")
    finally:
        rewards.close()
    seconds = time.perf_counter() - t0
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = OmegaConf.to_container(cfg, resolve=True)
    payload = {"config": config, "seconds": seconds, **results}
    json_path, table_path, plot_path = out_dir / "results.json", out_dir / "pass_at_k.md", out_dir / "pass_at_k.png"
    json_path.write_text(json.dumps(payload, indent=1))
    table = results_table(results)
    table_path.write_text(table)
    plot_pass_at_k(results, plot_path, title=f"{cfg.model.name_or_path}: pass@k (n={cfg.n}, T={cfg.temperature:g})")
    logger = build_logger(cfg)
    if logger is not None:
        logger.log_hyperparams(flatten(config))
        logger.log_metrics({mlflow_key(k): v for k, v in results["metrics"].items()}, step=0)
        logger.log_metrics({"eval/seconds": seconds}, step=0)
        for f in (json_path, table_path, plot_path):
            logger.experiment.log_artifact(logger.run_id, str(f))
        logger.finalize("success")
    lines = [f"Evaluated {cfg.model.name_or_path} on {', '.join(s.name for s in sets)} "
             f"({sum(len(s.problems) for s in sets)} problems x {cfg.n} samples) in {seconds:.1f} s.", "", table,
             f"  results: {json_path}", f"  table:   {table_path}", f"  plot:    {plot_path}"]
    if logger is not None:
        lines += [f"  MLflow run: {logger.run_id} (experiment {cfg.experiment_name!r})",
                  f"  view it:    mlflow ui --backend-store-uri {logger._tracking_uri}"]
    return {"results": results, "seconds": seconds, "run_id": getattr(logger, "run_id", None), "table": table,
            "paths": {"json": str(json_path), "table": str(table_path), "plot": str(plot_path)}, "text": "\n".join(lines)}
