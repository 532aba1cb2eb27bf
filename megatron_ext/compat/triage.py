"""Triage of a changed row on a new megatron-core: is the behaviour the row replaces still there?

One line per row, so a maintainer sees what to do without reading the function: ``still needed``,
``moved``, ``gone`` or ``changed`` (each explained in docs/compat.md). Example (``python -m megatron_ext.compat.check`` on megatron-core 0.18.2)::

    changed  cpu.current_device  megatron.core.transformer.moe.router.TopKRouter.__init__: ...
             still needed: torch.cuda.current_device (line 212), torch.cuda.current_device (line 221)
"""

import importlib
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from megatron_ext.compat.host_torch import HostTorch
from megatron_ext.compat.patch import Needs, Patch, original, replaced_function
from megatron_ext.compat.span import CudaUse, cuda_uses, lines_holding


@dataclass(frozen=True)
class Triage:
    """What became of a row's behaviour on the installed Megatron.

    Attributes:
        verdict: ``still needed``, ``moved``, ``gone`` or ``changed`` (docs/compat.md).
        detail: Where: the calls or lines and their line numbers, the function it moved to.
    """

    verdict: str
    detail: str

    def __str__(self) -> str:
        return f"{self.verdict}: {self.detail}"


def rerouted_calls(row: Patch, function: types.FunctionType) -> list[CudaUse]:
    """The calls of ``function`` a :class:`HostTorch` row reroutes: its ``torch.cuda.<name>``
    calls, and with ``factories`` its ``"cuda"`` devices."""
    host = row.replacement
    assert isinstance(host, HostTorch), row.name
    return [
        use
        for use in cuda_uses(function)
        if use.name in host.cuda or (host.factories and use.name == '"cuda"')
    ]


def _grouped(uses: Iterable[CudaUse]) -> list[str]:
    """``torch.cuda.current_device (lines 180, 189)``: each name once, with its lines."""
    lines: dict[str, list[int]] = {}
    for use in uses:
        lines.setdefault(use.label, []).append(use.line)
    return [f"{label} ({_lines(found)})" for label, found in lines.items()]


def _lines(found: list[int]) -> str:
    return ("line " if len(found) == 1 else "lines ") + ", ".join(map(str, found))


def _marks(row: Patch, function: types.FunctionType) -> list[str]:
    """Where ``function`` still holds what ``row`` replaces (empty: nowhere); for a row that
    replaces the whole function, the function itself."""
    if isinstance(row.replacement, HostTorch):
        return _grouped(rerouted_calls(row, function))
    if row.depends_on:
        held = lines_holding(function, row.depends_on)
        return [f"`{fragment}` ({_lines(lines)})" for fragment, lines in held.items() if lines]
    return [f"{function.__qualname__} (line {function.__code__.co_firstlineno})"]


def _not_rerouted(row: Patch, function: types.FunctionType) -> str:
    """``; not rerouted: torch.cuda.check_error (line 2790)`` for the CUDA uses of a
    :class:`HostTorch` row's function its row leaves alone (a new call it may need to add)."""
    rerouted = set(rerouted_calls(row, function))
    others = [use for use in cuda_uses(function) if use not in rerouted]
    return f"; not rerouted: {', '.join(_grouped(others))}" if others else ""


def module_functions(module: types.ModuleType) -> Iterator[tuple[str, types.FunctionType]]:
    """``(qualified name, function)`` of each function defined in ``module``'s file: its own and
    its classes' methods."""
    # Static and class methods by their function, decorated ones by their innermost body in the
    # file (the one a row's source is read from).
    filename = module.__file__

    def body(value: Any) -> types.FunctionType | None:
        value = getattr(value, "__func__", value)
        found = None
        while value is not None:
            if isinstance(value, types.FunctionType) and value.__code__.co_filename == filename:
                found = value
            value = getattr(value, "__wrapped__", None)
        return found

    for name, value in vars(module).items():
        if isinstance(value, type) and value.__module__ == module.__name__:
            for attribute, member in vars(value).items():
                if (function := body(member)) is not None:
                    yield f"{name}.{attribute}", function
        elif (function := body(value)) is not None:
            yield name, function


def _elsewhere(row: Patch, module: types.ModuleType, covered: set[str]) -> Triage | None:
    """Where in ``module`` the row's behaviour is, outside its own attribute: a function of the
    same name, else the functions (no row covers) that make the row's calls or hold its lines."""
    own = row.attribute.rpartition(".")[2]
    same = [(name, f) for name, f in module_functions(module) if name.rpartition(".")[2] == own]
    same = [(name, f) for name, f in same if name != row.attribute]
    uncovered = [(name, f) for name, f in same if f"{row.module}.{name}" not in covered]
    if uncovered:
        name, function = uncovered[0]
        marks = _marks(row, function)
        held = f" (still holds {', '.join(marks)})" if marks else " (without the call or line)"
        return Triage("moved", f"to {row.module}.{name}{held}")
    if same:
        names = ", ".join(name for name, _ in same)
        return Triage("gone", f"{row.name} is not there ({names}, of the same name, has a row)")
    if not isinstance(row.replacement, HostTorch) and not row.depends_on:
        return None
    found = [
        f"{name}: {', '.join(marks)}"
        for name, function in module_functions(module)
        if name != row.attribute and f"{row.module}.{name}" not in covered
        and (marks := _marks(row, function))
    ]  # fmt: skip
    if found:
        return Triage("moved", "now in " + "; ".join(found) + " (no row of its own)")
    return None


def triage(row: Patch, table: Iterable[Patch] = ()) -> Triage:
    """What became of ``row``'s behaviour on the installed Megatron (``table``: the other rows)."""
    # A call moved to a function another row of the same kind already covers is not "moved".
    covered = {r.name for r in table if type(r.replacement) is type(row.replacement)}
    try:
        value = original(row)
    except (RuntimeError, AttributeError, ImportError) as err:
        try:
            module = importlib.import_module(row.module)
        except ImportError:
            return Triage("gone", str(err))
        return _elsewhere(row, module, covered) or Triage("gone", f"{row.name} is not there")
    if isinstance(row.fingerprint, Needs):
        kind = "is" if row.fingerprint.met_by(value) else "is not"
        return Triage("changed", f"{type(value).__qualname__} {kind} {row.fingerprint}")
    if isinstance(value, type):
        return Triage("changed", f"the class {value.__qualname__} is there: read the change")
    # The row replaces the calls of a HostTorch, the lines it depends_on, or else the whole function.
    function = replaced_function(row, value)
    marks = _marks(row, function)
    if marks and not isinstance(row.replacement, HostTorch) and not row.depends_on:
        what = "copied whole" if row.group == "copied" else "wrapped or replaced whole"
        return Triage("changed", f"{marks[0]} is there ({what}: read the change)")
    if marks and isinstance(row.replacement, HostTorch):
        return Triage("still needed", ", ".join(marks) + _not_rerouted(row, function))
    if marks:
        return Triage("still needed", ", ".join(marks))
    # The function is there without what the row replaces: perhaps it moved to another function.
    module = importlib.import_module(row.module)
    moved = _elsewhere(row, module, covered)
    if isinstance(row.replacement, HostTorch):
        calls = [f"torch.cuda.{name}" for name in row.replacement.cuda]
        calls += ['a "cuda" device'] if row.replacement.factories else []
        what = "makes none of " + ", ".join(calls)
    else:
        what = "holds none of " + ", ".join(f"`{f}`" for f in row.depends_on)
    return moved or Triage("gone", f"the function is there but {what}: the row can go")
