"""Math reward: 1.0 if the completion's final answer equals the gold answer (math-verify), or,
for a problem that carries a task verifier (reasoning-gym), the task's own graded score.

Answers are extracted in the calling process and only the short extracted strings go to the verifier
pool: an in-process check cannot be hard-limited, and one hung check would stall training forever."""

from __future__ import annotations

import inspect
import os
import pickle
import time
from dataclasses import dataclass, field

import torch

from ngrpo_lightning.rewards.extract import EXTRACT_METHODS, extract_answer
from ngrpo_lightning.rewards.pool import VerifierPool
from ngrpo_lightning.rewards.task_score import score_task_answer

STATUSES = ("correct", "wrong", "no_answer", "timeout", "error")


@dataclass
class RewardResult:
    """Per-completion scores and why each got its score."""

    scores: torch.Tensor  # [N] float32: 1.0 correct / 0.0 otherwise (a task verifier may grade between)
    status: list[str]  # one of STATUSES per completion
    answers: list[str | None] = field(default_factory=list)  # extracted answers (None: no answer)
    worker_pids: list[int] = field(default_factory=list)  # debug: process that checked each item (0: none)
    elapsed_s: float = 0.0

    def __len__(self) -> int:
        return len(self.status)

    @property
    def correct(self) -> torch.Tensor:
        """[N] bool: fully correct answers (status ``correct``; a graded score below 1 is not)."""
        return torch.tensor([s == "correct" for s in self.status], dtype=torch.bool)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATUSES, 0)
        for s in self.status:
            out[s] += 1
        return out

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Fraction of completions per status, e.g. ``reward/timeout_frac``."""
        n = max(len(self.status), 1)
        return {f"{prefix}{s}_frac": c / n for s, c in self.counts().items()}


class MathReward:
    """``reward(completions, golds, verifiers=None) -> RewardResult``, safe against pathological
    answers. A non-None ``verifiers[i]`` (a reasoning-gym entry as JSON, :mod:`.task_score`) scores
    row ``i`` by that task's ``score_answer`` instead of math-verify.

    Args:
        extract: ``boxed`` or ``last_number`` (see :mod:`.extract`).
        answer_after: a marker (e.g. ``"</think>"``): the answer is read after its last occurrence,
            and a completion without it has none. ``None``: the whole completion (as the release).
        timeout_s: time limit per answer in the check's own CPU time; soft inside the worker
            (SIGPROF), hard at ``timeout_s + kill_grace_s`` by killing the pool (:mod:`.pool`).
        num_workers: verifier processes; default ``min(os.cpu_count(), 8)``.
        parallel_threshold: smaller batches are sent one answer per task, so pathological answers
            time out in parallel; larger ones are dealt round-robin into ``4 * num_workers`` chunks.
        kill_grace_s: slack past ``timeout_s`` before the hard kill.
        check_fn: ``(answer, gold) -> bool`` run in the workers, default
            :func:`~.verify.verify_answer`; must be picklable (a module-level function).
        start_timeout_s: how long the workers may take to start.
        graded: keep a task verifier's partial scores in [0, 1]; ``False`` (the config default)
            scores 1 only for ``correct`` answers.

    The pool starts on the first call (or :meth:`start`) and ends at :meth:`close` or exit.
    """

    def __init__(
        self,
        extract: str = "boxed",
        timeout_s: float = 2.0,
        num_workers: int | None = None,
        parallel_threshold: int = 32,
        kill_grace_s: float = 2.0,
        check_fn=None,
        start_timeout_s: float = 120.0,
        answer_after: str | None = None,
        graded: bool = False,
    ):
        if extract not in EXTRACT_METHODS:
            raise ValueError(f"reward.extract={extract!r} is unknown: allowed {list(EXTRACT_METHODS)}")
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0 seconds, got {timeout_s!r}")
        if num_workers is None:
            num_workers = min(os.cpu_count() or 1, 8)
        if int(num_workers) < 1:
            raise ValueError(f"reward.num_workers must be >= 1 (or null for min(cores, 8)), got {num_workers!r}")
        if parallel_threshold < 0:
            raise ValueError(f"reward.parallel_threshold must be >= 0, got {parallel_threshold!r}")
        if kill_grace_s < 0:
            raise ValueError(f"reward.kill_grace_s must be >= 0, got {kill_grace_s!r}")
        if check_fn is not None:
            try:
                pickle.dumps(check_fn)
            except Exception as e:
                raise TypeError(
                    f"check_fn must be picklable (a module-level function): verifier workers "
                    f"are spawned processes; got {check_fn!r}"
                ) from e
        if answer_after is not None and (not isinstance(answer_after, str) or not answer_after):
            raise ValueError(f"reward.answer_after={answer_after!r} must be a non-empty text (e.g. '</think>') or null")
        self.extract, self.answer_after = extract, answer_after
        self.timeout_s = float(timeout_s)
        self.num_workers = int(num_workers)
        self.parallel_threshold = int(parallel_threshold)
        self.kill_grace_s = float(kill_grace_s)
        self.check_fn = check_fn
        self.graded = bool(graded)
        self.pool = VerifierPool(self.num_workers, start_timeout_s=start_timeout_s)

    def __call__(
        self, completions: list[str], golds: list[str], verifiers: list[str | None] | None = None
    ) -> RewardResult:
        if len(completions) != len(golds):
            raise ValueError(f"got {len(completions)} completions but {len(golds)} gold answers")
        if verifiers is not None and len(verifiers) != len(golds):
            raise ValueError(f"got {len(verifiers)} verifier specs for {len(golds)} gold answers")
        t0 = time.monotonic()
        answers = [extract_answer(self.answer_part(c or ""), self.extract) for c in completions]
        status = ["no_answer"] * len(answers)
        pids = [0] * len(answers)
        scores = [0.0] * len(answers)
        by_task = verifiers or [None] * len(answers)
        math_items = [
            (i, a, str(g)) for i, (a, g) in enumerate(zip(answers, golds)) if a is not None and not by_task[i]
        ]
        task_items = [(i, a, by_task[i]) for i, a in enumerate(answers) if a is not None and by_task[i]]
        for items, check_fn in ((math_items, self.check_fn), (task_items, score_task_answer)):
            if not items:
                continue
            chunks = len(items) if len(items) < self.parallel_threshold else 4 * self.num_workers
            checked = self.pool.run(
                items,
                check_fn=check_fn,
                timeout_s=self.timeout_s,
                kill_after_s=self.timeout_s + self.kill_grace_s,
                num_chunks=chunks,
            )
            for i, (s, pid, score) in checked.items():
                status[i], pids[i] = s, pid
                scores[i] = score if self.graded else float(s == "correct")
        return RewardResult(torch.tensor(scores, dtype=torch.float32), status, answers, pids, time.monotonic() - t0)

    def answer_part(self, completion: str) -> str:
        """The part of ``completion`` the answer is read from (see ``answer_after``)."""
        if self.answer_after is None:
            return completion
        before, marker, after = completion.rpartition(self.answer_after)
        return after if marker else ""

    def start(self) -> list[int]:
        """Start the workers now (e.g. during setup) instead of on the first call; their PIDs."""
        return self.pool.start()

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> MathReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"MathReward(extract={self.extract!r}, timeout_s={self.timeout_s:g}, "
            f"num_workers={self.num_workers}, parallel_threshold={self.parallel_threshold})"
        )


# Above this share of the answers failing inside the verifier (status "error": not wrong answers,
# a check that raised or a worker that died) the rewards say nothing about the policy.
STOP_ERROR_FRAC = 0.5


def score_responses(reward, completions: list[str], golds: list[str], verifiers=None) -> RewardResult:
    """``reward(completions, golds)``, plus the rows' task verifier specs when any row has one and the reward takes a
    third argument. A batch whose answers mostly failed in the verifier itself is refused (:func:`check_verifier`)."""
    if verifiers is not None and any(v is not None for v in verifiers) and _takes_verifiers(reward):
        result = reward(completions, golds, list(verifiers))
    else:
        result = reward(completions, golds)
    check_verifier(result)
    return result


def check_verifier(result: RewardResult) -> None:
    """``RuntimeError`` when more than :data:`STOP_ERROR_FRAC` of at least 4 answers got the status ``error``."""
    errors = sum(s == "error" for s in result.status)
    answered = sum(s != "no_answer" for s in result.status)
    if answered >= 4 and errors > STOP_ERROR_FRAC * answered:
        raise RuntimeError(
            f"the verifier failed on {errors} of {answered} answers (status 'error': the check itself raised or its "
            "worker process died, these are not wrong answers); the rewards would be zeros of a broken check. Fix the "
            "verifier (data.verifier, reward.*) or what kills its workers (memory), then continue with resume=last"
        )


def _takes_verifiers(reward) -> bool:
    try:
        inspect.signature(reward).bind([], [], [])
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): assume the documented three arguments
        return True
    return True
