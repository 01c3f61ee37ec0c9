"""The unit of training data: one question with a verifiable gold answer."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class Problem:
    """A question and its gold answer (always a string: the verifier compares strings), dict-like for convenience
    (``p["question"]``, ``p.get("meta")``, ``dict(p)``)."""

    id: str
    question: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.keys() else default

    def keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
