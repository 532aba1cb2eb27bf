"""Registry of benchmarks run by ``megatron-ext bench``.

The figures that matter are ratios between columns of the same run, never absolute timings from
another machine. Example::

    @register_benchmark("hot_spot")
    def hot_spot(quick: bool) -> BenchResult:
        ...
        return BenchResult(title="...", columns=["padding", "peak/mean"], rows=[["constant", 1.37]])
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# fn(quick) -> table: quick is CI's size (seconds per benchmark), the full run docs/BENCHMARKS.md's.
BenchFn = Callable[[bool], "BenchResult"]


@dataclass
class BenchResult:
    """One benchmark's table.

    Attributes:
        title: Heading in docs/BENCHMARKS.md.
        columns: Column names.
        rows: Measured values, one list per row, same length as ``columns``.
        notes: What was measured and how to read it (setup, sizes, what the ratio means).
        extra: Raw figures for the JSON report.
        tables: Further tables of the same benchmark (a second measurement with columns of its
            own), each rendered under this one with its title and notes.
    """

    title: str
    columns: list[str]
    rows: list[list[Any]]
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    tables: list["BenchResult"] = field(default_factory=list)

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"{self.title}: row {row} does not match columns {self.columns}")


BENCHMARKS: dict[str, BenchFn] = {}


def register_benchmark(name: str) -> Callable[[BenchFn], BenchFn]:
    """Registers ``fn(quick: bool) -> BenchResult`` under ``name`` (unique)."""

    def register(fn: BenchFn) -> BenchFn:
        # A name is a --only argument and a section of the report: one function each.
        if name in BENCHMARKS:
            raise ValueError(f"benchmark {name!r} registered twice")
        BENCHMARKS[name] = fn
        return fn

    return register


def discover() -> dict[str, BenchFn]:
    """Imports every module of :mod:`megatron_ext.bench` so their benchmarks register; returns them."""
    import importlib
    import pkgutil

    import megatron_ext.bench as package

    # Every module but these two may register; importing is enough (registration is a decorator).
    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in ("registry", "report"):
            importlib.import_module(f"{package.__name__}.{info.name}")
    return dict(BENCHMARKS)
