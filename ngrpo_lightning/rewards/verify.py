"""Is an extracted answer equal to the gold answer? (math-verify, plus two guards)

* Gold answers are wrapped in ``$...$`` and predictions in ``\\boxed{...}`` unless they
  already carry math delimiters, so that bare ``12`` or ``\\frac{1}{2}`` parse as LaTeX.
* Multiple-choice golds (one capital letter) are compared as letters, not through math-verify,
  which reads ``E`` and ``I`` as Euler's number and the imaginary unit.
* Identical answers after light normalization always match (``10\\%``, plain words, which math-verify cannot parse).

math-verify's ``signal.alarm`` timeouts are disabled (main thread only; they would cancel an outer
timer): ``timeout_s`` is a soft limit, :class:`~ngrpo_lightning.rewards.MathReward` a hard one."""

from __future__ import annotations

import functools
import logging
import re

from math_verify import parse, verify

from ngrpo_lightning.rewards.limits import soft_time_limit

_CHOICE_RE = re.compile(r"^\(?\s*([A-Z])\s*\)?$")
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed\b|\\fbox\b")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\left\b|\\right\b|\s+")


class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns once per process that timeouts are off; here that is intended."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


def verify_answer(pred: str | None, gold: str, *, timeout_s: float | None = None) -> bool:
    """True if ``pred`` equals ``gold``; ``timeout_s``: soft limit raising ``TimeoutError`` (None: none)."""
    if pred is None:
        return False
    pred, gold = str(pred).strip(), str(gold).strip()
    if not pred or not gold:
        return False
    choice = _CHOICE_RE.match(gold)
    if choice:
        return _choice_letter(pred) == choice.group(1)
    if _normalize(pred) == _normalize(gold):
        return True
    with soft_time_limit(timeout_s):
        gold_parsed = _parse_gold(gold)
        pred_parsed = _parse(pred if _DELIMITED.search(pred) else f"\\boxed{{{pred}}}")
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


@functools.cache
def _warm_up() -> None:
    """math-verify's and sympy's first parse and comparison load what they load lazily."""
    verify(_parse("$1$"), _parse("\\boxed{1}"), timeout_seconds=None)


verify_answer.prepare = lambda answer, gold: _warm_up()  # outside the check's time limit (worker.py)


def _parse(latex: str) -> list:
    return parse(latex, parsing_timeout=None)


# Groups of rollouts share a gold answer: parse it once per worker.
@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    return _parse(gold if _DELIMITED.search(gold) else f"${gold}$")


def _normalize(answer: str) -> str:
    """Whitespace, TeX spacing, ``$``, ``\\text{}`` wrappers and a final period removed."""
    s = _UNESCAPED_DOLLAR.sub("", answer)
    s = _TEXT_WRAPPER.sub(r"\1", s)
    s = _SPACING.sub("", s)
    return s.rstrip(".")


def _choice_letter(pred: str) -> str | None:
    """``B``, ``(B)``, ``B)``, ``B.``, ``\\text{(B)}``, ``b`` -> ``B``; anything else -> None."""
    s = _normalize(pred).strip("()").rstrip(":)")
    return s.upper() if len(s) == 1 and s.isalpha() and s.isascii() else None
