"""Pass@k, Mean@k and Maj@k of n samples per problem.

``pass_at_k(n, c, k)`` is the unbiased estimator of Chen et al. (2021), the probability that at
least one of k samples drawn without replacement from n (c correct) is correct::

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)

The product form needs no binomials, which overflow a double for large n. :class:`PassAtK` is the
torchmetrics version, gathered across processes (``dist_reduce_fx="cat"``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from ngrpo_lightning.checks import check_number


def _check_int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, float) and value.is_integer():  # 4.0 from a config or a division is 4
        value = int(value)
    return check_number(name, value, minimum, integer=True)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``n`` samples, ``c`` correct; ``0 <= c <= n``, ``1 <= k <= n``."""
    n, c, k = _check_int("n", n, 1), _check_int("c", c, 0), _check_int("k", k, 1)
    if c > n:
        raise ValueError(f"c={c} correct samples is more than n={n} samples")
    if k > n:
        raise ValueError(f"pass@{k} needs at least k={k} samples per problem, got n={n}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def posterior_pass_at_k(n: int, c: int, k: int, prior: tuple[float, float] = (1.0, 1.0)) -> float:
    """Posterior mean of pass@k of one problem: with success rate ``p ~ Beta(a + c, b + n - c)``
    (``prior = (a, b)``, uniform by default), the mean of ``1 - (1 - p)^k``::

        1 - prod_{i=0}^{k-1} (b + n - c + i) / (a + b + n + i)

    Defined for any ``k``, never exactly 0 or 1, shrunk toward the prior for small ``n``, so it
    ranks arms more stably from few samples (Bayes@N, arXiv 2510.04265)."""
    n, c, k = _check_int("n", n, 1), _check_int("c", c, 0), _check_int("k", k, 1)
    if c > n:
        raise ValueError(f"c={c} correct samples is more than n={n} samples")
    a, b = (float(x) for x in prior)
    if a <= 0 or b <= 0:
        raise ValueError(f"prior={prior} must be two positive numbers (Beta(a, b))")
    prob_all_wrong = 1.0
    for i in range(k):
        prob_all_wrong *= (b + n - c + i) / (a + b + n + i)
    return 1.0 - prob_all_wrong


def powers_of_two(n: int) -> list[int]:
    """``[1, 2, 4, ...]`` up to ``n`` (the k of a pass@k curve)."""
    n = _check_int("n", n, 1)
    return [1 << i for i in range(n.bit_length()) if 1 << i <= n]


def mean_at_k(correct: Sequence, k: int | None = None) -> float:
    """Average accuracy of the first ``k`` samples (all samples when None) of one problem."""
    values = [float(x) for x in (correct.tolist() if isinstance(correct, torch.Tensor) else correct)]
    k = len(values) if k is None else _check_int("k", k, 1)
    if k > len(values) or not values:
        raise ValueError(f"mean@{k} needs at least k={k} samples, got {len(values)}")
    return sum(values[:k]) / k


def maj_at_k(answers: Sequence[str | None], correct: Sequence, k: int | None = None) -> float:
    """Majority vote over the first ``k`` extracted answers of one problem: 1.0 if the most frequent
    answer (no answer does not vote; ties to the first seen) belongs to a correct sample, else 0.0."""
    correct = [bool(x) for x in (correct.tolist() if isinstance(correct, torch.Tensor) else correct)]
    if len(answers) != len(correct):
        raise ValueError(f"got {len(answers)} answers but {len(correct)} correctness flags")
    k = len(answers) if k is None else _check_int("k", k, 1)
    if k > len(answers) or not answers:
        raise ValueError(f"maj@{k} needs at least k={k} samples, got {len(answers)}")
    votes = Counter(a for a in answers[:k] if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(a for a in answers[:k] if a is not None and votes[a] == top)
    return float(any(ok for a, ok in zip(answers[:k], correct[:k]) if a == winner))


class PassAtK(Metric):
    """Pass@k over problems, reduced across processes. ``update(correct, answers=None)``: ``correct`` is ``[P, n]``
    0/1 (or per-problem sequences of any length); ``answers`` the extracted answers alike, for Maj@n. ``compute()``
    returns the means over problems of ``pass@k`` for each k in ``ks`` (default: powers of two up to the smallest n),
    ``mean@n`` and ``maj@n`` (when answers were given for every problem)."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, ks: Sequence[int] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.ks = None if ks is None else [_check_int("k", k, 1) for k in ks]
        self.add_state("n", default=[], dist_reduce_fx="cat")
        self.add_state("c", default=[], dist_reduce_fx="cat")
        self.add_state("maj", default=[], dist_reduce_fx="cat")  # NaN: no answers given

    def update(self, correct, answers: Sequence[Sequence[str | None]] | None = None) -> None:
        rows = [[bool(x) for x in (r.tolist() if isinstance(r, torch.Tensor) else r)] for r in correct]
        if answers is not None and len(answers) != len(rows):
            raise ValueError(f"got answers for {len(answers)} problems but correctness for {len(rows)}")
        if any(not r for r in rows):
            raise ValueError("every problem needs at least one sample")
        if self.ks and rows and min(map(len, rows)) < max(self.ks):
            raise ValueError(
                f"pass@{max(self.ks)} needs at least {max(self.ks)} samples per problem, got n={min(map(len, rows))}"
            )
        maj = [
            maj_at_k(a, r) if answers is not None else float("nan")
            for a, r in zip(answers if answers is not None else rows, rows)
        ]
        self.n.append(torch.tensor([len(r) for r in rows], dtype=torch.long, device=self.device))
        self.c.append(torch.tensor([sum(r) for r in rows], dtype=torch.long, device=self.device))
        self.maj.append(torch.tensor(maj, dtype=torch.float64, device=self.device))

    def _states(self):
        as_tensor = lambda s, dtype: (
            dim_zero_cat(s) if isinstance(s, torch.Tensor) or s else torch.zeros(0, dtype=dtype)
        )  # noqa: E731
        return as_tensor(self.n, torch.long), as_tensor(self.c, torch.long), as_tensor(self.maj, torch.float64)

    def compute(self) -> dict[str, torch.Tensor]:
        n, c, maj = self._states()
        if n.numel() == 0:
            raise ValueError("PassAtK.compute() called before any update")
        n_min = int(n.min())
        ks = self.ks or powers_of_two(n_min)
        if max(ks) > n_min:
            raise ValueError(f"pass@{max(ks)} needs at least {max(ks)} samples per problem, got n={n_min}")
        nl, cl = n.tolist(), c.tolist()
        mean = lambda xs: torch.tensor(sum(xs) / len(nl), dtype=torch.float64)  # noqa: E731
        out = {f"pass@{k}": mean(pass_at_k(a, b, k) for a, b in zip(nl, cl)) for k in ks}
        out[f"mean@{n_min}"] = mean(b / a for a, b in zip(nl, cl))
        if not torch.isnan(maj).any():
            out[f"maj@{n_min}"] = maj.double().mean().cpu()
        return out

    def per_problem(self) -> list[tuple[int, int]]:
        """``(n, c)`` of every problem seen by this process (not reduced)."""
        n, c, _ = self._states()
        return list(zip(n.tolist(), c.tolist()))
