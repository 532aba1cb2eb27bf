"""Megatron's modules as they are where Transformer Engine imports, on a machine without it.

Megatron binds some module attributes only when TE imports (``try: from
megatron.core.extensions.transformer_engine import fused_apply_rotary_pos_emb`` / ``except
ImportError: ... = None``, megatron-core 0.19.2 ``models/common/embeddings/rope_utils.py``).
:func:`te_bound_attributes` finds them by reading the modules' source; :func:`standin` is what
such an attribute holds on a GPU node here: a callable (or class) that never runs.

As ``sitecustomize`` (this folder first on ``PYTHONPATH``), it binds the attributes named in
``MEGATRON_EXT_TEST_TE_STANDINS`` (JSON ``{module: [attribute, ...]}``) right after each module is
imported, in every interpreter of the command (the example scripts' dry runs), and says so on
stderr in one line per module.
"""

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys

ENV = "MEGATRON_EXT_TEST_TE_STANDINS"
#: What the bound marker line on stderr starts with.
MARKER = "te stand-ins bound in"


def te_bound_attributes(modules: list[str]) -> dict[str, list[str]]:
    """``{module: [attribute, ...]}``: names each module imports from a Transformer Engine module
    (TE's own or Megatron's extension of it) inside a top-level ``try`` (bound only where TE
    imports). Modules are read, not imported."""
    found: dict[str, list[str]] = {}
    for module in modules:
        with open(importlib.util.find_spec(module).origin) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if not isinstance(node, ast.Try):
                continue
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and "transformer_engine" in (stmt.module or ""):
                    names = [alias.asname or alias.name for alias in stmt.names]
                    found.setdefault(module, []).extend(names)
    return found


def standin(name: str) -> object:
    """What ``name`` is where TE imports, as far as a startup check can tell: a class for a
    CamelCase name, else a function; neither runs."""

    def never_runs(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"Transformer Engine's {name} stood in: it never runs here")

    if name[:1].isupper():
        cls = type(name, (), {"__init__": never_runs})
        cls.__module__ = "transformer_engine.pytorch"
        return cls
    never_runs.__name__ = never_runs.__qualname__ = name
    never_runs.__module__ = "megatron.core.extensions.transformer_engine"
    return never_runs


class _BindAfterImport(importlib.abc.MetaPathFinder):
    """Finds the wanted modules as the path finder does; binds the stand-ins once each executed."""

    def __init__(self, wanted: dict[str, list[str]]) -> None:
        self.wanted = wanted

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 (importlib's protocol)
        if name not in self.wanted:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute, names = spec.loader.exec_module, self.wanted[name]

        def exec_module(module) -> None:  # noqa: ANN001
            execute(module)
            for attribute in names:
                setattr(module, attribute, standin(attribute))
            print(f"{MARKER} {name}: {', '.join(names)}", file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(ENV):
    sys.meta_path.insert(0, _BindAfterImport(json.loads(os.environ[ENV])))
