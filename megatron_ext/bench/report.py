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
    # Four significant digits: the tables compare ratios of one run, not raw timings.
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def to_markdown(results: list[tuple[str, BenchResult, float]], command: str) -> str:
    """Renders results as docs/BENCHMARKS.md."""
    return render_markdown(to_json(results, command))


def render_markdown(report: dict[str, Any]) -> str:
    """docs/BENCHMARKS.md from a report as :func:`to_json` writes it; a section measured in another
    run than the header's (``--update``) names its own date, machine and command."""
    lines = [
        "# megatron_ext benchmarks",
        "",
        "Written by the benchmark command; do not edit by hand. Every figure below was measured in the run",
        "described here (or the one its section names), ours beside Megatron's path and a baseline in the",
        "same process.",
        "",
        f"- date: {_minute(report['date'])}",
        f"- machine: {report['machine']}",
        f"- command: `{report['command']}`",
        "",
    ]
    for name, entry in report["benchmarks"].items():
        result = _result(entry)
        where = f"benchmark `{name}`, {entry['seconds']:.1f} s"
        if entry.get("command", report["command"]) != report["command"]:
            where += (
                f"; measured {_minute(entry['date'])} on {entry['machine']} by `{entry['command']}`"
            )
        lines += [f"## {result.title}", "", where, ""]
        lines += _table(result)
        for table in result.tables:
            lines += [f"### {table.title}", "", *_table(table)]
    return "\n".join(lines)


def _minute(iso: str) -> str:
    return datetime.datetime.fromisoformat(iso).strftime("%Y-%m-%d %H:%M UTC")


def _result(entry: dict[str, Any]) -> BenchResult:
    """A report entry back as the :class:`BenchResult` it was written from."""
    tables = [BenchResult(t["title"], t["columns"], t["rows"], t["notes"]) for t in entry["tables"]]
    return BenchResult(
        entry["title"], entry["columns"], entry["rows"], entry["notes"], entry["extra"], tables
    )


def merged_report(previous: dict[str, Any], fresh: dict[str, Any]) -> dict[str, Any]:
    """``previous`` with ``fresh``'s benchmarks replaced or added, each stamped with the run that
    measured it (date, machine, command); the others keep theirs. Registry order."""
    stamp = {key: fresh[key] for key in ("date", "machine", "command")}
    header = {key: previous[key] for key in ("date", "machine", "command")}
    entries = {name: {**header, **entry} for name, entry in previous["benchmarks"].items()} | {
        name: {**entry, **stamp} for name, entry in fresh["benchmarks"].items()
    }
    # Registry order, so an --update leaves the sections where a full run puts them; a benchmark
    # no longer registered keeps its section, last.
    order = list(discover())
    ordered = sorted(entries, key=lambda n: order.index(n) if n in order else len(order))
    return {**header, "benchmarks": {name: entries[name] for name in ordered}}


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
    """``megatron-ext bench``: runs, prints and writes the report (``--update``: merged into the
    existing ``--json`` and ``--markdown``, which keep the other benchmarks' figures)."""
    from megatron_ext.common.safe_files import atomic_write_bytes, check_output_file

    command = "megatron-ext " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    outputs = [(f, p) for f, p in (("--markdown", args.markdown), ("--json", args.json)) if p]
    previous = _previous_report(args) if args.update else None
    for flag, path in outputs:  # before minutes of benchmarks, not after
        check_output_file(path, flag=flag, overwrite=args.overwrite or args.update)
    if len({os.path.abspath(p) for _, p in outputs}) < len(outputs):
        raise ValueError("--markdown and --json are the same file")
    results = run_benchmarks(args.only, args.quick)
    # The markdown is always rendered from the JSON report, so an --update's merge is one path.
    report = to_json(results, command)
    if previous is not None:
        report = merged_report(previous, report)
    markdown = render_markdown(report)
    print(markdown)
    if args.markdown:
        atomic_write_bytes(args.markdown, markdown.encode())
    if args.json:
        atomic_write_bytes(args.json, json.dumps(report, indent=2, default=str).encode())
    return 0


def _previous_report(args: Any) -> dict[str, Any]:
    """The report ``--update`` merges into: the existing ``--json`` (the markdown is rendered
    from it), for named benchmarks only."""
    if not args.only or not args.json or not args.markdown:
        raise ValueError(
            "--update re-runs the benchmarks named by --only and merges them into the existing "
            "--json and --markdown: give all three"
        )
    if not os.path.isfile(args.json):
        raise ValueError(f"--update: --json {args.json} does not exist (nothing to merge into)")
    with open(args.json, encoding="utf-8") as f:
        previous = json.load(f)
    if not isinstance(previous, dict) or not isinstance(previous.get("benchmarks"), dict):
        raise ValueError(f"--update: --json {args.json} is not a benchmark report")
    return previous
