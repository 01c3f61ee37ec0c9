"""Pass@k evaluation of a policy on benchmark sets: the core of ``callbacks.PassAtK`` and ``ngrpo eval``.

Each problem is sampled ``n`` times with plain sampling, scored, and counted in a
:class:`~ngrpo_lightning.metrics.PassAtK` metric. Outputs: metrics ``<prefix>/<set>/pass@k``, ``mean@n``, ``maj@n`` and
averages ``<prefix>/avg/...``; a markdown table in the paper's layout; a pass@k plot; per-problem results (JSON)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.loggers import MLFlowLogger

from ngrpo_lightning.data import PromptDataset
from ngrpo_lightning.metrics.pass_at_k import PassAtK, powers_of_two
from ngrpo_lightning.rewards import MathReward, score_responses


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


def check_ks(ks: Sequence[int] | None, n: int) -> list[int]:
    """The k of pass@k: ``ks`` (each 1 <= k <= n) or the powers of two up to ``n``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (samples per problem) must be a positive integer, got {n!r}")
    if ks is None:
        return powers_of_two(n)
    ks = [int(k) for k in ks]
    bad = [k for k in ks if k < 1 or k > n]
    if bad:
        raise ValueError(
            f"pass@k needs 1 <= k <= n: k={bad[0]} with n={n} samples per problem (raise n or drop k={bad[0]})"
        )
    return sorted(set(ks))


# ---------------------------------------------------------------- the core
class RewardCache:
    """One reward per answer format; ``default`` serves its own. Rewards created here close in :meth:`close`."""

    def __init__(self, default=None, timeout_s: float = 2.0, num_workers: int | None = None):
        self.default, self.timeout_s, self.num_workers = default, timeout_s, num_workers
        self.created: dict[str, object] = {}

    def __call__(self, answer_format: str):
        if self.default is not None and getattr(self.default, "extract", answer_format) == answer_format:
            return self.default
        if answer_format not in self.created:
            self.created[answer_format] = MathReward(
                extract=answer_format, timeout_s=self.timeout_s, num_workers=self.num_workers
            )
        return self.created[answer_format]

    def close(self) -> None:
        for reward in self.created.values():
            reward.close()
        self.created.clear()


def evaluate_sets(
    engine,
    tokenizer,
    datasets,
    explorer,
    n: int,
    max_new_tokens: int,
    rewards: Callable | RewardCache,
    batch_size: int = 8,
    ks: Sequence[int] | None = None,
    prefix: str = "val",
    rank: int = 0,
    world_size: int = 1,
    prompt_defaults: Mapping | None = None,
    progress: Callable | None = None,
    device: torch.device | str | None = None,
) -> dict:
    """Sample every problem ``n`` times and score it; returns ``{"metrics": {...}, "sets":
    {name: {"metrics", "problems": [{id, answer, n, c, answers, status}]}}, "ks", "n"}``. With
    ``world_size > 1`` each process (all must call) evaluates every ``world_size``-th problem
    from ``rank``; the metrics (on ``device``) are reduced, records are this process's."""
    ks = check_ks(ks, n)
    if not isinstance(rewards, RewardCache):
        rewards = RewardCache(default=rewards)
    out = {"n": n, "ks": ks, "sets": {}, "metrics": {}}
    for ev in as_eval_sets(datasets):
        kwargs = {k: v for k, v in (prompt_defaults or {}).items() if v is not None}
        kwargs.update(
            {
                k: v
                for k, v in {"instruction": ev.instruction, "system_prompt": ev.system_prompt}.items()
                if v is not None
            }
        )
        prompts = PromptDataset(
            ev.problems[rank::world_size], tokenizer, max_prompt_tokens=ev.max_prompt_tokens, **kwargs
        )
        reward = rewards(ev.answer_format)
        metric = PassAtK(ks=ks, sync_on_compute=world_size > 1).to(device or "cpu")
        records = []
        # every process makes as many generate calls (an FSDP engine gathers the weights in each):
        # shorter shares end with an unscored padding prompt
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
            scored = score_responses(
                reward, batch.response_text, golds, [it.get("verifier") for it in items for _ in range(n)]
            )
            correct = scored.correct.view(len(items), n)
            answers = list(scored.answers) if scored.answers else [None] * len(golds)
            grouped = [answers[i * n : (i + 1) * n] for i in range(len(items))]
            metric.update(correct, grouped)
            for i, it in enumerate(items):
                records.append(
                    {
                        "id": it["id"],
                        "answer": it["answer"],
                        "n": n,
                        "c": int(correct[i].sum()),
                        "answers": grouped[i],
                        "status": list(scored.status[i * n : (i + 1) * n]),
                    }
                )
            if progress is not None:
                progress(ev.name, min(start + batch_size, len(prompts)), len(prompts))
        if world_size == 1 and not records:
            raise ValueError(f"evaluation set {ev.name!r} has no problems")
        values = {k: float(v) for k, v in metric.compute().items()}
        out["sets"][ev.name] = {"metrics": values, "problems": records}
        out["metrics"].update({f"{prefix}/{ev.name}/{k}": v for k, v in values.items()})
    names = list(out["sets"])
    shared = (
        [k for k in out["sets"][names[0]]["metrics"] if all(k in out["sets"][s]["metrics"] for s in names)]
        if names
        else []
    )
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
    """Log the table, plot and per-problem JSON (read by ``ngrpo compare``) under ``artifact_dir``; others: no-op."""
    if not isinstance(logger, MLFlowLogger):
        return []
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(local_dir) if local_dir is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        table, plot, data = folder / "pass_at_k.md", folder / "pass_at_k.png", folder / "results.json"
        table.write_text(results_table(results))
        plot_pass_at_k(results, plot)
        data.write_text(json.dumps(results, default=str))
        for f in (table, plot, data):
            logger.experiment.log_artifact(logger.run_id, str(f), artifact_path=artifact_dir)
    return [f"{artifact_dir}/{f.name}" for f in (table, plot, data)]
