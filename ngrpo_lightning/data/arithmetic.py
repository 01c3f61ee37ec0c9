"""A built-in procedural task: integer arithmetic with exact answers.

``What is 7 + 3 * 2?`` -> ``13``. Expressions follow the usual precedence (``*`` before
``+``/``-``, left to right otherwise); the answer is computed here by folding products
first, and the tests check it against Python's own evaluation of the question text.

Splits are disjoint by construction: every question text hashes (CRC32, stable across runs
and machines) into one of ten buckets; bucket 0 belongs to ``validation``, bucket 1 to
``test`` and the rest to ``train``. A split keeps only the questions of its buckets, so no
validation question can ever appear in train, whatever the two sizes. Each split also has
its own random stream, derived from ``(seed, split)``.

Validation and test problems are distinct; train problems are drawn with replacement
(small operand ranges allow fewer distinct questions than a long training run needs).
"""

from __future__ import annotations

import random
import zlib

from ..checks import check_number
from .problem import Problem

OPERATORS = ("+", "-", "*")
SPLITS = ("train", "validation", "test")
_BUCKETS = 10
_SPLIT_BUCKETS = {"validation": {0}, "test": {1}, "train": set(range(2, _BUCKETS))}


class ArithmeticTask:
    """Seeded generator of :class:`Problem` s; ``problems()`` returns the list."""

    def __init__(
        self,
        num_problems: int,
        seed: int = 0,
        min_operand: int = 0,
        max_operand: int = 20,
        min_ops: int = 1,
        max_ops: int = 2,
        operators=OPERATORS,
        split: str = "train",
    ):
        _check_int("data.train_size / data.val_size (num_problems)", num_problems, minimum=0)
        _check_int("data.min_operand", min_operand)
        _check_int("data.max_operand", max_operand)
        _check_int("data.min_ops", min_ops, minimum=1)
        _check_int("data.max_ops", max_ops, minimum=1)
        if min_operand > max_operand:
            raise ValueError(f"data.min_operand={min_operand} is larger than data.max_operand={max_operand}")
        if min_ops > max_ops:
            raise ValueError(f"data.min_ops={min_ops} is larger than data.max_ops={max_ops}")
        if isinstance(operators, str):
            operators = (operators,)
        operators = tuple(operators)
        unknown = [op for op in operators if op not in OPERATORS]
        if not operators or unknown:
            raise ValueError(
                f"data.operators={list(operators)!r}: unknown {unknown or 'empty list'}; allowed: {list(OPERATORS)}"
            )
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is unknown: allowed {list(SPLITS)}")
        self.num_problems, self.seed, self.split = num_problems, seed, split
        self.min_operand, self.max_operand = min_operand, max_operand
        self.min_ops, self.max_ops = min_ops, max_ops
        self.operators = operators
        self._problems: list[Problem] | None = None

    def problems(self) -> list[Problem]:
        if self._problems is None:
            self._problems = self._generate()
        return self._problems

    def __len__(self) -> int:
        return self.num_problems

    def __iter__(self):
        return iter(self.problems())

    def _generate(self) -> list[Problem]:
        # A string seed is hashed with SHA-512 by `random`: stable across runs (no PYTHONHASHSEED).
        rng = random.Random(f"ngrpo-arithmetic/{self.seed}/{self.split}")
        buckets = _SPLIT_BUCKETS[self.split]
        distinct = self.split != "train"
        seen: set[str] = set()
        out: list[Problem] = []
        # Enough tries to find rare buckets; beyond it the knobs allow too few questions.
        budget = 200 * self.num_problems + 10_000
        while len(out) < self.num_problems:
            budget -= 1
            if budget < 0:
                raise ValueError(
                    f"cannot draw {self.num_problems} distinct {self.split} problems: the knobs allow only "
                    f"about {len(seen)}; widen data.max_operand / data.max_ops or lower data.val_size"
                )
            operands, ops = self._draw(rng)
            expression = _format(operands, ops)
            if zlib.crc32(expression.encode()) % _BUCKETS not in buckets:
                continue
            if distinct and expression in seen:
                continue
            seen.add(expression)
            out.append(
                Problem(
                    id=f"arith-{self.split}-{self.seed}-{len(out)}",
                    question=f"What is {expression}?",
                    answer=str(evaluate(operands, ops)),
                    meta={"expression": expression, "num_ops": len(ops), "split": self.split},
                )
            )
        return out

    def _draw(self, rng: random.Random) -> tuple[list[int], list[str]]:
        n_ops = rng.randint(self.min_ops, self.max_ops)
        operands = [rng.randint(self.min_operand, self.max_operand) for _ in range(n_ops + 1)]
        ops = [rng.choice(self.operators) for _ in range(n_ops)]
        return operands, ops

    def __repr__(self) -> str:
        return (
            f"ArithmeticTask(num_problems={self.num_problems}, seed={self.seed}, split={self.split!r}, "
            f"operands=[{self.min_operand}, {self.max_operand}], ops=[{self.min_ops}, {self.max_ops}], "
            f"operators={self.operators})"
        )


def evaluate(operands: list[int], ops: list[str]) -> int:
    """Value of ``operands[0] ops[0] operands[1] ...`` with ``*`` binding tighter."""
    terms, signs = [operands[0]], []
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            signs.append(op)
            terms.append(x)
    total = terms[0]
    for sign, term in zip(signs, terms[1:]):
        total = total + term if sign == "+" else total - term
    return total


def _format(operands: list[int], ops: list[str]) -> str:
    # Negative operands in parentheses: "3 - (-2)", never "3 - -2".
    text = [str(x) if x >= 0 else f"({x})" for x in operands]
    parts = [text[0]]
    for op, x in zip(ops, text[1:]):
        parts += [op, x]
    return " ".join(parts)


def _check_int(key: str, value, minimum: int | None = None) -> None:
    check_number(key, value, minimum, integer=True)
