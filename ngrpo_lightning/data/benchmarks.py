"""Evaluation benchmarks (AIME24/25, AMC23, MATH500, GPQA-Diamond) and their loading.

A benchmark config (``conf/data/<name>.yaml``, ``source: benchmark``) names a Hugging Face dataset (``hub_id``,
``subset``, ``split``) and its fields; ``path`` (a file or saved dataset) replaces the Hub. GPQA-Diamond
(``format: gpqa``) lists its four options as (A)-(D) in an order seeded by the question, the gold answer a letter."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

from ngrpo_lightning.data import loaders
from ngrpo_lightning.data.loaders import MissingFieldError, load_problems
from ngrpo_lightning.data.problem import Problem

GPQA_FIELDS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
LETTERS = "ABCD"


def format_multiple_choice(
    question: str, correct: str, incorrect: list[str], key: str | None = None
) -> tuple[str, str]:
    """``(question text listing the options (A)-(D), gold letter)``, shuffled with a seed from ``key``
    (default: the question), the same on every run and machine."""
    options = [str(correct).strip()] + [str(x).strip() for x in incorrect]
    if len(options) > len(LETTERS):
        raise ValueError(f"at most {len(LETTERS)} options are supported, got {len(options)}")
    seed = int.from_bytes(hashlib.sha256((key or question).encode("utf-8")).digest()[:8], "big")
    order = list(range(len(options)))
    random.Random(seed).shuffle(order)
    lines = [f"({LETTERS[i]}) {options[j]}" for i, j in enumerate(order)]
    gold = LETTERS[order.index(0)]
    return f"{str(question).strip()}\n\n" + "\n".join(lines), gold


def gpqa_problem(record: dict[str, Any], where: str, default_id: str, id_field: str | None = None) -> Problem:
    """A GPQA record -> a multiple-choice :class:`Problem` (answer: the letter)."""
    for name in GPQA_FIELDS + ((id_field,) if id_field else ()):
        if record.get(name) is None:
            state = "is null" if name in record else "is missing"
            raise MissingFieldError(f"{where}: field {name!r} (GPQA format) {state}; fields present: {sorted(record)}")
    text, gold = format_multiple_choice(
        record["Question"], record["Correct Answer"], [record[f"Incorrect Answer {i}"] for i in (1, 2, 3)]
    )
    return Problem(
        id=str(record[id_field]) if id_field else default_id,
        question=text,
        answer=gold,
        meta={"source": where, "format": "gpqa"},
    )


def load_benchmark(cfg) -> list[Problem]:
    """Problems of a ``source: benchmark`` data config (see the module docstring)."""
    get = cfg.get if hasattr(cfg, "get") else (lambda k, d=None: getattr(cfg, k, d))
    source = get("path") or get("hub_id")
    if not source:
        raise ValueError(f"data ({get('name', 'benchmark')}): set data.path (a local file) or data.hub_id")
    split, limit, id_field = get("split", "test"), get("limit"), get("id_field")
    fmt = get("format")
    if fmt in (None, "plain") and not get("subset"):
        return load_problems(
            source,
            problem_field=get("problem_field", "problem"),
            answer_field=get("answer_field", "answer"),
            split=split,
            id_field=id_field,
            limit=limit,
        )
    if fmt not in (None, "plain", "gpqa"):
        raise ValueError(f"data.format={fmt!r} is unknown: allowed [null, 'gpqa']")
    records, name = _records(str(source), split, get("subset"))
    out = []
    for index, (where, record) in enumerate(records):
        if limit is not None and index >= limit:
            break
        if fmt == "gpqa":
            out.append(gpqa_problem(record, where, f"{name}-{index}", id_field))
        else:
            out.append(
                _plain_problem(
                    record,
                    where,
                    f"{name}-{index}",
                    get("problem_field", "problem"),
                    get("answer_field", "answer"),
                    id_field,
                )
            )
    return out


def _plain_problem(record, where, default_id, problem_field, answer_field, id_field) -> Problem:
    """One problem of a plain (question, answer) benchmark, fields read as ``data=files`` reads them."""
    return loaders._Fields(problem_field, answer_field, id_field).to_problem(record, where, default_id)


def _records(source: str, split: str, subset: str | None):
    """(``(where, record)`` iterator, dataset name) of a file, dataset directory or Hub id."""
    path = Path(source).expanduser()
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise FileNotFoundError(f"problem file not found: {path}")
        return loaders._jsonl_records(path), path.stem
    if path.suffix == ".parquet":
        if not path.is_file():
            raise FileNotFoundError(f"problem file not found: {path}")
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return ((f"{path} row {i}", r) for i, r in enumerate(rows)), path.stem
    import datasets

    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(source, subset, split=split)
    except (OSError, ValueError) as e:
        raise OSError(
            f"could not load dataset {source!r} (subset {subset!r}, split {split!r}): {e}. "
            "Offline, point data.path at a local .jsonl/.parquet file with the same fields"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[split]
    where = f"{source} [{split}]"
    return ((f"{where} row {i}", r) for i, r in enumerate(ds)), path.name if path.is_dir() else source.rsplit("/", 1)[
        -1
    ]
