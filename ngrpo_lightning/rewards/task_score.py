"""A task's own verifier, run inside the verifier workers (kept free of torch, like :mod:`.worker`).

Problems from reasoning-gym carry their generated entry (question, answer, metadata) as JSON
text, their *verifier spec*; the task's ``score_answer`` reads the metadata (a graded score in
[0, 1] for some tasks). reasoning-gym is imported on the first task answer a worker checks, so
math-only runs never pay for it.
"""

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
