"""Runs registered benchmarks and writes docs/BENCHMARKS.md (+ JSON) with date, machine and command."""

import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from megatron_ext.bench.registry import BenchResult, discover


def machine_description() -> str:
    """CPU model, core count, memory and accelerator, as measured on this machine."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {mem_gb:.0f} GiB, {device}; torch {torch.__version__}"


def run_benchmarks(names: list[str] | None, quick: bool) -> list[tuple[str, BenchResult, float]]:
    """Runs the named benchmarks (all when None); returns (name, result, seconds) in order."""
    registry = discover()
    unknown = sorted(set(names or []) - set(registry))
    if unknown:
        raise ValueError(f"--only: unknown benchmark(s) {unknown}; known: {sorted(registry)}")
    results = []
    for name, fn in registry.items():
        if names and name not in names:
            continue
        print(f"[bench] {name} ...", flush=True)
        start = time.perf_counter()
        result = fn(quick)
        seconds = time.perf_counter() - start
        print(f"[bench] {name} done in {seconds:.1f} s", flush=True)
        results.append((name, result, seconds))
    return results


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def to_markdown(results: list[tuple[str, BenchResult, float]], command: str) -> str:
    """Renders results as docs/BENCHMARKS.md."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# megatron_ext benchmarks",
        "",
        "Written by the benchmark command; do not edit by hand. Every figure below was measured in the run",
        "described here, ours beside Megatron's path and a baseline in the same process.",
        "",
        f"- date: {now}",
        f"- machine: {machine_description()}",
        f"- command: `{command}`",
        "",
    ]
    for name, result, seconds in results:
        lines += [f"## {result.title}", "", f"benchmark `{name}`, {seconds:.1f} s", ""]
        lines += _table(result)
        for table in result.tables:
            lines += [f"### {table.title}", "", *_table(table)]
    return "\n".join(lines)


def _table(result: BenchResult) -> list[str]:
    """One table's markdown lines: header, rows, notes, a blank line."""
    lines = ["| " + " | ".join(result.columns) + " |", "|" + "---|" * len(result.columns)]
    for row in result.rows:
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    if result.notes:
        lines += ["", result.notes]
    return [*lines, ""]


def to_json(results: list[tuple[str, BenchResult, float]], command: str) -> dict[str, Any]:
    """Machine-readable twin of :func:`to_markdown`."""
    return {
        "command": command,
        "machine": machine_description(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "benchmarks": {
            name: {
                "title": r.title,
                "columns": r.columns,
                "rows": r.rows,
                "notes": r.notes,
                "extra": r.extra,
                "tables": [
                    {"title": t.title, "columns": t.columns, "rows": t.rows, "notes": t.notes}
                    for t in r.tables
                ],
                "seconds": s,
            }
            for name, r, s in results
        },
    }


def main(args: Any) -> int:
    """``megatron-ext bench``: runs, prints and writes the report."""
    from megatron_ext.common.safe_files import atomic_write_bytes, check_output_file

    command = "megatron-ext " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    outputs = [(f, p) for f, p in (("--markdown", args.markdown), ("--json", args.json)) if p]
    # megatron-ext bench's own parser (not Megatron's) sets --overwrite; a caller's namespace may
    # omit it.
    overwrite = getattr(args, "overwrite", False)
    for flag, path in outputs:  # before minutes of benchmarks, not after
        check_output_file(path, flag=flag, overwrite=overwrite)
    if len({os.path.abspath(p) for _, p in outputs}) < len(outputs):
        raise ValueError("--markdown and --json are the same file")
    results = run_benchmarks(args.only, args.quick)
    markdown = to_markdown(results, command)
    print(markdown)
    if args.markdown:
        atomic_write_bytes(args.markdown, markdown.encode())
    if args.json:
        report = json.dumps(to_json(results, command), indent=2, default=str)
        atomic_write_bytes(args.json, report.encode())
    return 0
