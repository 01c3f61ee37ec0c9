"""A task's own verifier, run inside the verifier workers (kept free of torch, like :mod:`.worker`).

reasoning-gym problems carry their generated entry as JSON, their *verifier spec*, which the task's
``score_answer`` reads. reasoning-gym is imported on a worker's first task answer only."""

from __future__ import annotations

import functools
import json


def score_task_answer(answer: str, spec: str) -> float:
    """reasoning-gym's score of the extracted ``answer`` for the entry in ``spec``."""
    entry = json.loads(spec)
    return float(_scorer(entry["metadata"]["source_dataset"])(answer, entry))


def _prepare(answer: str, spec: str) -> None:
    """Import reasoning-gym and find the task's scorer, outside the check's time limit (worker.py)."""
    try:
        _scorer(json.loads(spec)["metadata"]["source_dataset"])
    except Exception:  # noqa: BLE001 - a bad spec is the check's error, reported by the check itself
        pass


score_task_answer.prepare = _prepare


@functools.cache
def _scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)
