"""Problems from a ``.jsonl`` or ``.parquet`` file or a Hugging Face dataset (Hub id or local directory), e.g.
DeepScaleR's ``problem`` / ``answer`` layout. Errors name the file (and line), the missing field and those present."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ngrpo_lightning.data.problem import Problem

FILE_SUFFIXES = (".jsonl", ".parquet")
# Names with these suffixes are files, never Hugging Face ids (even when they do not exist).
_FILE_LIKE_SUFFIXES = FILE_SUFFIXES + (".json", ".csv", ".tsv", ".txt", ".arrow")


class MissingFieldError(KeyError, ValueError):
    """A record lacks the problem/answer/id field (catchable as KeyError or ValueError)."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


def load_problems(
    source: str | os.PathLike,
    problem_field: str = "problem",
    answer_field: str = "answer",
    split: str = "train",
    id_field: str | None = None,
    limit: int | None = None,
) -> list[Problem]:
    """Problems from ``source``, answers as ``str``. ``split``: Hugging Face datasets only; ``limit``: the
    first N records; without ``id_field`` ids are ``<name>-<index>``."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"data.limit must be a non-negative integer or null, got {limit!r}")
    fields = _Fields(problem_field, answer_field, id_field)
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.suffix in _FILE_LIKE_SUFFIXES or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"problem file not found: {path}")
        if path.suffix == ".jsonl":
            records = _jsonl_records(path)
        elif path.suffix == ".parquet":
            records = _parquet_records(path, fields)
        else:
            raise ValueError(
                f"{path}: unsupported file type {path.suffix!r}; allowed: {list(FILE_SUFFIXES)}, "
                "a dataset directory or a Hugging Face dataset id"
            )
        name = path.stem
    elif path.is_dir() or _looks_like_hub_id(text):
        records = _hf_records(text if not path.is_dir() else str(path), split, fields)
        name = path.name if path.is_dir() else text.rsplit("/", 1)[-1]
    else:
        raise FileNotFoundError(
            f"problem source not found: {path} (expected a .jsonl or .parquet file, "
            "a dataset directory or a Hugging Face dataset id)"
        )
    out = []
    for index, (where, record) in enumerate(records):
        if limit is not None and index >= limit:
            break
        out.append(fields.to_problem(record, where, default_id=f"{name}-{index}"))
    if not out and limit != 0:
        raise ValueError(f"{text}: the source holds no problems (an empty file or split)")
    return out


class _Fields:
    """Which record fields hold the question, answer and id; turns a record into a Problem."""

    def __init__(self, problem: str, answer: str, id_: str | None):
        self.problem, self.answer, self.id = problem, answer, id_

    def required(self) -> list[tuple[str, str]]:
        req = [(self.problem, "data.problem_field"), (self.answer, "data.answer_field")]
        return req + ([(self.id, "data.id_field")] if self.id else [])

    def columns(self) -> list[str]:
        """The top-level columns the fields read (``reward_model.ground_truth`` reads ``reward_model``)."""
        return list(dict.fromkeys(name.split(".")[0] for name, _ in self.required()))

    def check_columns(self, columns, where: str) -> None:
        for name, key in self.required():
            if name.split(".")[0] not in columns:
                raise MissingFieldError(f"{where}: no field {name!r} ({key}); fields present: {sorted(columns)}")

    def to_problem(self, record: Any, where: str, default_id: str) -> Problem:
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object per record, got {type(record).__name__}")
        values = {}
        for name, key in self.required():
            values[name] = field_value(record, name)
            if values[name] is None:
                state = "is null" if _has_field(record, name) else "is missing"
                raise MissingFieldError(f"{where}: field {name!r} ({key}) {state}; fields present: {sorted(record)}")
        question = chat_question(values[self.problem])
        if not isinstance(question, str) or not question.strip():
            raise ValueError(
                f"{where}: field {self.problem!r} (data.problem_field) must be non-empty text, got {question!r:.80}"
            )
        return Problem(
            id=str(values[self.id]) if self.id else default_id,
            question=question,
            answer=_answer_text(values[self.answer]),
            meta={"source": where},
        )


def field_value(record: dict, name: str) -> Any:
    """``record[name]``; a dotted name reads nested objects (verl's ``reward_model.ground_truth``)."""
    value: Any = record
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _has_field(record: dict, name: str) -> bool:
    head, _, rest = name.partition(".")
    return head in record and (not rest or (isinstance(record[head], dict) and _has_field(record[head], rest)))


def chat_question(value: Any) -> Any:
    """A question given as chat messages (verl's ``prompt``: ``[{"role": "user", "content": ...}]``)
    is its last user message's content; anything else is returned as it is."""
    if isinstance(value, list | tuple) and value and all(isinstance(m, dict) and "content" in m for m in value):
        users = [m["content"] for m in value if m.get("role", "user") == "user"]
        return users[-1] if users else None
    return value


def _answer_text(value: Any) -> str:
    # 12.0 from a float column is the integer 12; keep everything else verbatim.
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))  # a column past the line's end, not one of the next line
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON line ({e.msg} at column {e.colno})") from None
            yield f"{path}:{lineno}", record


def _parquet_records(path: Path, fields: _Fields) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    fields.check_columns(pq.read_schema(path).names, str(path))
    table = pq.read_table(path, columns=fields.columns())
    for row, record in enumerate(table.to_pylist()):
        yield f"{path} row {row}", record


def _hf_records(source: str, split: str, fields: _Fields) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        if Path(source, "dataset_dict.json").is_file() or Path(source, "state.json").is_file():
            ds = datasets.load_from_disk(source)  # written by Dataset(Dict).save_to_disk
        else:
            ds = datasets.load_dataset(source, split=split)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"could not load dataset {source!r} (split {split!r}): {e}") from e
    except OSError as e:  # offline / unreachable Hub; a mistyped local path also lands here
        hint = "" if Path(source).exists() else " (there is no local file or directory of that name either)"
        raise OSError(f"could not load dataset {source!r} (split {split!r}){hint}: {e}") from e
    except ValueError as e:  # e.g. an unknown split
        raise ValueError(f"could not load dataset {source!r} (split {split!r}): {e}") from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(
                f"{source}: no split {split!r} (data.split / data.val_split); splits present: {sorted(ds)}"
            )
        ds = ds[split]
    where = f"{source} [{split}]"
    fields.check_columns(ds.column_names, where)
    for row, record in enumerate(ds):
        yield f"{where} row {row}", record


def _looks_like_hub_id(text: str) -> bool:
    """``name`` or ``org/name`` that is not a filesystem-looking path."""
    if text.startswith(("/", ".", "~")) or text.count("/") > 1 or not text:
        return False
    return all(part and all(c.isalnum() or c in "-_." for c in part) for part in text.split("/"))
