"""Problems from reasoning-gym, the library of procedural, verifiable reasoning tasks.

``data=reasoning_gym data.tasks=[chain_sum]`` draws problems from one or several of its
generators (``chain_sum``, ``basic_arithmetic``, ``gsm_symbolic``, ``prime_factorization``, ...),
mixed by weight through reasoning-gym's own ``composite`` dataset, each with its settings::

    tasks:
      - {name: chain_sum, weight: 2, config: {min_terms: 2, max_terms: 3, max_digits: 2}}
      - basic_arithmetic            # a bare name: weight 1, the task's default settings

The run's ``seed`` picks the stream. Splits are disjoint by construction: a question's text hashes (CRC32) into one of
ten buckets, bucket 0 validation, 2-9 train. Each problem keeps its entry as JSON in ``meta["verifier"]``:
``verifier: task`` scores it with the task's own ``score_answer``; ``math_verify`` checks the gold answer with
math-verify instead (sound where answers are numbers)."""

from __future__ import annotations

import difflib
import json
import zlib
from dataclasses import fields
from typing import Any

from omegaconf import ListConfig, OmegaConf

from ngrpo_lightning.checks import check_choice, check_number
from ngrpo_lightning.data.problem import Problem

VERIFIERS = ("task", "math_verify")
# reasoning-gym draws item i from Random(seed + i), so nearby seeds share a shifted stream: space them
_SEED_STRIDE = 10_000_019
_BUCKETS = 10
_SPLIT_BUCKETS = {"validation": {0}, "train": set(range(2, _BUCKETS))}


def reasoning_gym_problems(tasks, size: int, seed: int, split: str = "train", verifier: str = "task") -> list[Problem]:
    """``size`` problems of ``split`` from the weighted mixture of ``tasks`` (see the module)."""
    from reasoning_gym import create_dataset
    from reasoning_gym.composite import DatasetSpec

    check_number("data.train_size / data.val_size", size, 0, integer=True)
    check_choice("data.verifier", verifier, VERIFIERS)
    check_choice("split", split, _SPLIT_BUCKETS)
    specs = [DatasetSpec(t["name"], t["weight"], t["config"]) for t in task_list(tasks)]
    budget = 200 * size + 10_000  # enough draws to fill validation's one bucket in ten
    stream = create_dataset("composite", size=budget, seed=_SEED_STRIDE * seed, datasets=specs)
    buckets, distinct = _SPLIT_BUCKETS[split], split != "train"
    seen: set[str] = set()
    out: list[Problem] = []
    for index in range(budget):
        if len(out) == size:
            break
        entry = stream[index]
        question = entry["question"]
        if zlib.crc32(question.encode()) % _BUCKETS not in buckets or (distinct and question in seen):
            continue
        seen.add(question)
        task = entry["metadata"]["source_dataset"]
        meta: dict[str, Any] = {"source": f"reasoning_gym:{task}", "split": split}
        if verifier == "task":
            meta["verifier"] = json.dumps(entry, default=str)
        out.append(Problem(id=f"rg-{split}-{seed}-{index}", question=question, answer=str(entry["answer"]), meta=meta))
    if len(out) < size:
        raise ValueError(
            f"cannot draw {size} distinct {split} problems from data.tasks={[t['name'] for t in task_list(tasks)]}: "
            f"found {len(out)} in {budget} draws; widen the tasks' settings or lower data.val_size"
        )
    return out


def task_list(tasks) -> list[dict]:
    """``data.tasks`` as ``[{name, weight, config}]``, checked (names, positive weights, settings)."""
    from reasoning_gym.factory import DATASETS

    if isinstance(tasks, ListConfig):
        tasks = OmegaConf.to_container(tasks, resolve=True)
    if isinstance(tasks, str | dict) or not tasks:
        raise ValueError(f"data.tasks={tasks!r} must be a non-empty list of task names or {{name, weight, config}}")
    out = []
    for i, task in enumerate(tasks):
        key = f"data.tasks[{i}]"
        task = {"name": task} if isinstance(task, str) else dict(task)
        unknown = set(task) - {"name", "weight", "config"}
        if unknown or "name" not in task:
            raise ValueError(f"{key}={task!r}: allowed keys are name, weight, config (name required)")
        name = task["name"]
        if name not in DATASETS or name == "composite":
            close = difflib.get_close_matches(str(name), DATASETS, n=3)
            hint = f"; did you mean {close}?" if close else ""
            names = sorted(n for n in DATASETS if n != "composite")
            raise ValueError(f"{key}.name={name!r} is not a reasoning-gym task{hint} Allowed: {names}")
        weight = check_number(f"{key}.weight", task.get("weight", 1.0), 0.0, low_open=True)
        config = dict(task.get("config") or {})
        allowed = {f.name for f in fields(DATASETS[name][1])} - {"seed", "size"}
        bad = sorted(set(config) - allowed)
        if bad:
            raise ValueError(f"{key}.config: {bad} are not settings of {name!r}; allowed: {sorted(allowed)}")
        try:
            settings = DATASETS[name][1](**config)
            if hasattr(settings, "validate"):
                settings.validate()
        except (AssertionError, ValueError, TypeError) as err:
            raise ValueError(f"{key}.config={config} is not valid for {name!r}: {err}") from err
        out.append({"name": name, "weight": float(weight), "config": config})
    names = [t["name"] for t in out]
    if len(set(names)) != len(names):
        raise ValueError(f"data.tasks names a task twice ({names}): give it one entry with its weight")
    return out
