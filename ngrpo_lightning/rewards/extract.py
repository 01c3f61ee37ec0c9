"""Pull the final answer out of a model completion.

* ``boxed`` -- the content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``), brace-balanced, as the
  DeepSeek-R1 / DeepScaleR prompt asks. A last box that never closes (a truncated completion) is
  *no answer*: rewarding an earlier, intermediate box would reward truncation.
* ``last_number`` -- the last number in the text (GSM8K-style), thousands separators removed.
* ``boxed_or_last_number`` -- ``boxed`` when the text has a box, else ``last_number``: for small
  models that answer "The answer is 12."; use strict ``boxed`` for reasoning models."""

from __future__ import annotations

import re

EXTRACT_METHODS = ("boxed", "last_number", "boxed_or_last_number")

# \b keeps \fboxsep / \boxedfoo from matching.
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
# Braces that count for balancing; escaped ones (\{ \} in set notation) do not.
_BRACE_RE = re.compile(r"\\[{}]|[{}]")
# A minus sign only when it cannot be a binary minus ("10-3" -> 3, not -3).
_NUMBER_RE = re.compile(r"(?:(?<![\w)\].])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def extract_answer(text: str, method: str = "boxed") -> str | None:
    """The final answer in ``text`` by ``method`` (see module docstring); None if absent."""
    if method == "boxed":
        return _last_boxed(text)
    if method == "last_number":
        return _last_number(text)
    if method == "boxed_or_last_number":
        return _last_boxed(text) if _BOX_RE.search(text) else _last_number(text)
    raise ValueError(f"reward.extract={method!r} is unknown: allowed {list(EXTRACT_METHODS)}")


def _last_boxed(text: str) -> str | None:
    last = None
    for last in _BOX_RE.finditer(text):  # noqa: B007 - the loop keeps the last match
        pass
    if last is None:
        return None
    rest = text[last.end() :]
    body = rest.lstrip()
    if not body.startswith("{"):
        # "\boxed 42" (TeX allows an undelimited one-token argument).
        if len(body) == len(rest):  # no whitespace after the command: not a box
            return None
        token = re.match(r"[^\s$]+", body)
        return token.group(0) if token else None
    start = len(rest) - len(body) + 1
    depth = 0
    for m in _BRACE_RE.finditer(rest, start - 1):
        tok = m.group(0)
        if tok == "{":
            depth += 1
        elif tok == "}":
            depth -= 1
            if depth == 0:
                content = rest[start : m.start()].strip()
                return content or None
    return None  # unbalanced: truncated completion


def _last_number(text: str) -> str | None:
    last = None
    for last in _NUMBER_RE.finditer(text):  # noqa: B007 - the loop keeps the last match
        pass
    return None if last is None else last.group(0).replace(",", "")
