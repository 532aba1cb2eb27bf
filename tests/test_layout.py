"""Tier: pure (the package's source read, nothing imported). The package layout docs/architecture.md
describes: one package per concern, at most five modules at the top level, no import circle between
modules or between packages (every import counted, those inside functions too), the test harness and
the benchmarks out of what a user's launch imports, and every module named in the architecture's
table, in its package's row.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_ext"


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of megatron_ext (a package by its ``__init__``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """The megatron_ext modules ``module`` imports, anywhere in its source."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {r for n in names if (r := _resolve(n)) and r != module}
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _package(module: str) -> str:
    """``megatron_ext.data`` for ``megatron_ext.data.padding``; a top-level module is its own."""
    parts = module.split(".")
    if len(parts) > 2 or MODULES[module].name == "__init__.py":
        return ".".join(parts[:2])
    return module


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circle_between_modules() -> None:
    assert _cycles(GRAPH) == []


def test_no_import_circle_between_packages() -> None:
    packages: dict[str, set[str]] = {}
    for module, imported in GRAPH.items():
        packages.setdefault(_package(module), set()).update(
            p for m in imported if (p := _package(m)) != _package(module)
        )
    # The root package (its version string) is imported by all and imports none of them.
    assert GRAPH["megatron_ext"] == set()
    assert _cycles(packages) == []


def test_at_most_five_modules_at_the_top_level() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "launcher.py", "pretrain_gpt.py"]


def _closure(start: list[str]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += GRAPH[module]
    return seen


def test_what_a_user_runs_imports_no_test_harness_or_benchmark() -> None:
    """The launch, the launcher, the demo, ``rehearse`` and the tools: none reaches testing/ or
    bench/ (``megatron-ext bench`` is the one command that imports them)."""
    users = ["megatron_ext.pretrain_gpt", "megatron_ext.launcher", "megatron_ext.rehearse.demo",
             "megatron_ext.rehearse.matrix", "megatron_ext.cli.tool_commands",
             "megatron_ext.cli.flag_reference"]  # fmt: skip
    reached = _closure(users)
    assert "megatron_ext.training.forward_step" in reached  # the walk follows the launch
    assert not [m for m in reached if _package(m) in ("megatron_ext.testing", "megatron_ext.bench")]
    bench_users = {m for m, imported in GRAPH.items() if any(
        _package(i) == "megatron_ext.bench" for i in imported) and _package(m) != "megatron_ext.bench"}  # fmt: skip
    assert bench_users == {"megatron_ext.cli.command"}


def test_the_architecture_names_every_module_in_its_package_row() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| `megatron_ext/([a-z_]+)/` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    missing = []
    for path in MODULES.values():
        if path.name == "__init__.py":
            continue
        relative = path.relative_to(PACKAGE)
        if len(relative.parts) == 1:
            if f"`megatron_ext/{relative}`" not in text and f"`{relative}`" not in text:
                missing.append(str(relative))
        elif f"`{relative.name}`" not in rows.get(relative.parts[0], ""):
            missing.append(str(relative))
    assert rows and missing == []
