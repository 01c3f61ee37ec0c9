"""The dated records of ``benchmarks/results/records/`` as one markdown page.

    python benchmarks/render.py > docs/measurements.md
    python benchmarks/render.py --check docs/measurements.md   # exit 1 where the file is not what it prints

Speed-up records (``"question": "speedup"``: one speed-up, one kind of device, the same run with it and
without it) make one table, sorted by speed-up then date, with the ratio ``without / with``: above 1 the
speed-up pays where lower is better, below 1 where higher is better (the metric says which). Every other
record (a benchmark's own JSON) gets a section of its own: its name, date, commit, machine, workload and
summary figures, nested dictionaries flattened one level and raw per-run lists left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RECORDS = Path(__file__).resolve().parent / "results" / "records"
MEASURED = ("question", "benchmark", "date", "commit", "cpu", "machine", "cores", "workload")  # said apart


def load(folder: Path = RECORDS) -> list[tuple[str, dict]]:
    """``(file name, record)`` for every JSON record in ``folder``, by file name."""
    return [(path.name, json.loads(path.read_text())) for path in sorted(folder.glob("*.json"))]


def number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def machine(record: dict) -> str:
    """The machine in words, from a speed-up record's ``machine`` or a benchmark's ``cpu`` and ``cores``."""
    m = record.get("machine") or {}
    cpu = record.get("cpu") if isinstance(record.get("cpu"), dict) else {}
    if m.get("gpu"):
        return m["gpu"]
    bf16 = m.get("avx512_bf16", cpu.get("avx512_bf16"))
    cores = m.get("cores", record.get("cores"))
    parts = [
        m.get("cpu") or cpu.get("processor") or cpu.get("cpu"),
        m.get("kernels") or cpu.get("kernels"),
        {True: "with avx512_bf16", False: "without avx512_bf16"}.get(bf16),
        f"{cores} cores" if cores else None,
        " ".join(["kernels held by", *(f"{k}={v}" for k, v in m["kernel_limits"].items())])
        if m.get("kernel_limits")
        else None,
    ]
    return ", ".join(p for p in parts if p) or "not named"


def speedup_table(records: list[tuple[str, dict]]) -> list[str]:
    lines = [
        "| speed-up | device | date | machine | workload | metric | with | without | without / with |",
        "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for _, r in sorted(records, key=lambda item: (item[1]["speedup"], item[1]["date"], item[0].removesuffix(".json"))):
        metric = r["metric"] if r.get("lower_is_better", True) else f"{r['metric']} (higher is better)"
        ratio = f"{r['without'] / r['with']:.2f}" if r["with"] else ""
        row = [r["speedup"], r["device"], r["date"], machine(r), r["workload"], metric]
        lines.append("| " + " | ".join(cell(c) for c in row + [number(r["with"]), number(r["without"]), ratio]) + " |")
    return lines


def figures(record: dict) -> list[str]:
    """The record's figures as ``- key: value`` lines, dictionaries one level deep, lists left out."""
    lines = []
    for key, value in record.items():
        if key in MEASURED or isinstance(value, list):
            continue
        if not isinstance(value, dict):
            lines.append(f"- {key}: {number(value)}")
            continue
        for sub, inner in value.items():
            if isinstance(inner, dict):
                shown = ", ".join(f"{k} {number(v)}" for k, v in inner.items() if not isinstance(v, (list, dict)))
                if shown:
                    lines.append(f"- {key}.{sub}: {shown}")
            elif not isinstance(inner, list):
                lines.append(f"- {key}.{sub}: {number(inner)}")
    return lines


def section(name: str, record: dict) -> list[str]:
    title = record.get("benchmark") or record.get("question") or name.removesuffix(".json")
    lines = [f"## {title} ({record.get('date', 'undated')})", ""]
    lines += [f"- commit: {record.get('commit') or 'not given'}", f"- machine: {machine(record)}"]
    if record.get("workload"):
        lines.append(f"- workload: {record['workload']}")
    return lines + figures(record) + [f"- file: `{name}`", ""]


def render(records: list[tuple[str, dict]]) -> str:
    speedups = [(n, r) for n, r in records if r.get("question") == "speedup"]
    others = [(n, r) for n, r in records if r.get("question") != "speedup"]
    lines = [
        "# Measurements",
        "",
        "Made by `python benchmarks/render.py` from the dated records in `benchmarks/results/records/`; "
        "edit those, not this page.",
        "",
        "## Speed-ups, with and without",
        "",
        *speedup_table(speedups),
        "",
    ]
    for name, record in others:
        lines += section(name, record)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from what this prints")
    args = parser.parse_args(argv)
    text = render(load())
    if args.check is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.check)
    if path.exists() and path.read_text() == text:
        return 0
    print(f"{path} is not what benchmarks/render.py prints: run python benchmarks/render.py > {path}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
