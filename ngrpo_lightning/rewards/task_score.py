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


@functools.cache
def _scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)
