"""One row of the compatibility table (:class:`Patch`), its fingerprint, and applying rows reversibly.

:func:`patched_rows` applies rows for the length of a block and puts every original back;
:func:`apply` keeps them (a launch). Applying is idempotent per row. Example::

    with patched_rows(rows("cpu")):   # Megatron's model stack runs on CPU inside the block
        ...
    # outside it, every attribute is Megatron's own again
"""

import contextlib
import hashlib
import importlib
import inspect
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from megatron_ext.compat.host_torch import HostTorch, innermost_function, rebind, renamed_code
from megatron_ext.compat.span import cuda_span, fragment_span, function_lines, span_text
from megatron_ext.compat.versions import TESTED_MEGATRON


@dataclass(frozen=True)
# An optional kernel is bound to TE's function or to None depending on the machine, not on
# Megatron's version: its source says nothing of the version, its kind is what the row relies on.
class Needs:
    """What a row needs of a value whose source is not Megatron's own to fingerprint (an optional
    Transformer Engine kernel, a clock): such a row is checked by kind, not by source.

    Attributes:
        kinds: Each acceptable kind: ``"callable"``, ``"None"`` or a type's name (``"float"``).
    """

    kinds: tuple[str, ...]

    def __str__(self) -> str:
        return " or ".join("a callable" if k == "callable" else k for k in self.kinds)

    def met_by(self, value: Any) -> bool:
        """Whether ``value`` is of one of the kinds."""
        return any(
            (kind == "callable" and callable(value))
            or (kind == "None" and value is None)
            or type(value).__name__ == kind
            for kind in self.kinds
        )


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One change megatron_ext makes to Megatron's behaviour (keyword data: one row of table.py).

    Attributes:
        group: What applies it (``cpu.*``, ``cpu_loop.*``, ``launch``, ...); see table.py.
        module: The Megatron module holding the attribute.
        attribute: Dotted path inside ``module`` (``"Router.gating"``).
        replacement: A :class:`HostTorch` (the function's own ``torch`` calls those names on the
            host), ``"package.module:factory"`` (``factory(original)`` returns the new value), or
            ``None`` for a row applied by its owner (named in ``reason``) or a body copied from it.
        reason: Why Megatron's own behaviour does not do.
        fingerprint: :func:`row_fingerprint` of the original, the same on every version in
            ``versions`` or one per version (``{"0.18.2": ..., "0.19.2": ...}``), or the
            :class:`Needs` of a value that is not Megatron-defined code.
        depends_on: Fragments of the lines of Megatron's function the replacement exists for
            (``"sys.exit()"``): the row fingerprints only the statements holding them, and the
            check says whether they are still there. Empty: a :class:`HostTorch` row's are its
            CUDA calls; any other row's the whole function or class (a factory that replaces the
            body, a copy).
        versions: The megatron-core versions the row applies on (and was checked on): every
            supported one unless the attribute, or the behaviour the row replaces, is not there
            on some (``("0.19.2",)``). A row whose replacement differs between versions is one
            row per version.
    """

    group: str
    module: str
    attribute: str
    replacement: HostTorch | str | None
    reason: str
    # hash=False: a per-version dict does not hash (rows compare by value all the same).
    fingerprint: "str | Needs | dict[str, str]" = field(hash=False)
    depends_on: tuple[str, ...] = ()
    versions: tuple[str, ...] = TESTED_MEGATRON

    def __post_init__(self) -> None:
        assert not (self.depends_on and isinstance(self.replacement, HostTorch)), (
            f"{self.name}: a HostTorch row depends on the CUDA calls it reroutes"
        )
        assert set(self.versions) <= set(TESTED_MEGATRON), f"{self.name}: {self.versions}"
        assert not isinstance(self.fingerprint, dict) or set(self.fingerprint) == set(
            self.versions
        ), f"{self.name}: a fingerprint for each of {self.versions}"

    def applies_on(self, version: str) -> bool:
        """Whether the row applies on the tested megatron-core ``version``."""
        return version in self.versions

    def fingerprint_on(self, version: str) -> "str | Needs":
        """The fingerprint (or :class:`Needs`) the row was checked with on ``version``."""
        assert self.applies_on(version), f"{self.name} does not apply on {version}"
        if isinstance(self.fingerprint, dict):
            return self.fingerprint[version]
        return self.fingerprint

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"


def _owner_and_name(row: Patch) -> tuple[Any, str]:
    """The object holding the row's attribute (module or class) and the attribute's name."""
    # A missing owner raises AttributeError; a missing attribute says which table to revisit.
    owner: Any = importlib.import_module(row.module)
    *path, name = row.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    if not hasattr(owner, name):
        raise RuntimeError(
            f"megatron_ext.compat: {row.name} is gone; this megatron-core version needs the "
            "compatibility table revisited (megatron_ext/compat/table.py)"
        )
    return owner, name


#: ``id(row)`` -> how to undo it, for every row applied in this process, in order of applying.
# An undo is ("code", function, old code, new code, module, alias) for a HostTorch row, else
# ("attr", owner, old value, new value, name).
_APPLIED: dict[int, tuple[Any, ...]] = {}


def original(row: Patch) -> Any:
    """Megatron's own object for ``row``, whether or not the row is applied now."""
    if applied(row) and _APPLIED[id(row)][0] == "attr":
        return _APPLIED[id(row)][2]
    # A HostTorch row changes the function's code, not the attribute: the attribute is Megatron's.
    owner, name = _owner_and_name(row)
    # The class's own __dict__ first: a staticmethod or classmethod as defined, not as bound.
    return owner.__dict__.get(name, getattr(owner, name))


def _digest(lines: list[str]) -> str:
    """sha256 (16 hex digits) of ``lines``, each stripped, blank and comment-only lines dropped."""
    kept = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def fingerprint(obj: Any) -> str:
    """The digest of all of ``obj``'s source lines, each stripped, blank and comment-only lines
    dropped: a change of code or docstring changes it, a change of indentation or comments does not.
    """
    obj = getattr(obj, "__func__", obj)
    obj = inspect.unwrap(obj) if callable(obj) and not isinstance(obj, type) else obj
    if isinstance(obj, types.FunctionType):
        # Off the code object, no tokenizing: a launch hashes ~100 functions in milliseconds.
        lines = function_lines(obj)[1]
    elif isinstance(obj, type):
        lines = inspect.getsource(obj).splitlines()
    else:  # None where an optional kernel is not installed, a number: a row's Needs checks those
        raise TypeError(f"a {type(obj).__qualname__} has no source to fingerprint")
    return _digest(lines)


def replaced_function(row: Patch, value: Any) -> types.FunctionType:
    """The Megatron function behind ``value`` (the row's original) whose source the row reads: the
    body a :class:`HostTorch` row rebinds, else the innermost function of a decorator chain."""
    if isinstance(row.replacement, HostTorch):
        return innermost_function(value, importlib.import_module(row.module).__file__)
    function = inspect.unwrap(getattr(value, "__func__", value))
    if not isinstance(function, types.FunctionType):
        raise TypeError(f"a {type(function).__qualname__} has no lines to depend on")
    return function


def row_fingerprint(row: Patch, value: Any) -> str:
    """The fingerprint of ``value`` (the row's original) over the span that matters to ``row``: a
    :class:`HostTorch` row's statements that touch CUDA, the statements holding a row's
    ``depends_on``, else the whole function or class (:func:`fingerprint`)."""
    if isinstance(row.replacement, HostTorch):
        function = replaced_function(row, value)
        return _digest(span_text(function, cuda_span(function)))
    if row.depends_on:
        function = replaced_function(row, value)
        return _digest(span_text(function, fragment_span(function, row.depends_on)))
    return fingerprint(value)


def _alias(row: Patch) -> str:
    return "_megatron_ext_torch__" + row.attribute.replace(".", "__")


def _rebound_function(row: Patch) -> tuple[Any, types.FunctionType, str]:
    """A :class:`HostTorch` row's module, the function it rebinds and the alias it reads."""
    owner, name = _owner_and_name(row)
    module = importlib.import_module(row.module)
    return module, innermost_function(owner.__dict__.get(name), module.__file__), _alias(row)


def prepare(rows: Iterable[Patch]) -> None:
    """Computes what applying ``rows`` would compute (their functions' renamed code) and installs
    nothing."""
    # A preloaded launch server calls it once, so each rank forked from it applies the rows
    # without re-reading every instruction.
    for row in rows:
        if isinstance(row.replacement, HostTorch) and not applied(row):
            _, function, alias = _rebound_function(row)
            renamed_code(function, alias)


def _apply_one(row: Patch) -> tuple[Any, ...]:
    """Applies ``row``; returns how to undo it."""
    if isinstance(row.replacement, HostTorch):
        # The proxy goes in the module's globals under the alias the rebound code reads.
        module, function, alias = _rebound_function(row)
        setattr(module, alias, row.replacement.proxy())
        previous = rebind(function, alias)
        return ("code", function, previous, function.__code__, module, alias)
    owner, name = _owner_and_name(row)
    assert isinstance(row.replacement, str), f"{row.name} is applied by its owner"
    factory_module, factory_name = row.replacement.split(":")
    factory = getattr(importlib.import_module(factory_module), factory_name)
    previous = owner.__dict__.get(name, getattr(owner, name))
    new = factory(previous)
    setattr(owner, name, new)
    return ("attr", owner, previous, new, name)


def _in_place(undo: tuple[Any, ...]) -> bool:
    """Whether what ``undo`` installed is still there (a test may have replaced it since)."""
    if undo[0] == "code":
        return undo[1].__code__ is undo[3]
    _, owner, _, new, name = undo
    return owner.__dict__.get(name, getattr(owner, name, None)) is new


def _undo(undo: tuple[Any, ...]) -> None:
    # What replaced ours since (a test's own patch) is left alone: it undoes itself.
    if not _in_place(undo):
        return
    if undo[0] == "code":
        _, function, previous, _, module, alias = undo
        function.__code__ = previous
        delattr(module, alias)
    else:
        _, owner, previous, _, name = undo
        setattr(owner, name, previous)


def applied(row: Patch) -> bool:
    """Whether ``row`` is applied in this process now (and nothing replaced it since)."""
    return id(row) in _APPLIED and _in_place(_APPLIED[id(row)])


def apply(rows: Iterable[Patch]) -> list[Patch]:
    """Applies each row not applied now, in order; returns the rows it applied."""
    done = []
    for row in rows:
        if not applied(row):
            # A row undone behind our back (a test replaced it) is applied again, last in order.
            _APPLIED.pop(id(row), None)
            _APPLIED[id(row)] = _apply_one(row)
            done.append(row)
    return done


def restore(rows: Iterable[Patch]) -> None:
    """Puts Megatron's own attribute back for each applied row (in reverse order of applying)."""
    wanted = {id(row) for row in rows}
    # Reversed: two rows on one attribute put back the first one's original last.
    for key in reversed([k for k in _APPLIED if k in wanted]):
        _undo(_APPLIED.pop(key))


@contextlib.contextmanager
def patched_rows(rows: Iterable[Patch]) -> Iterator[list[Patch]]:
    """Within the block the rows are applied; on exit the ones this block applied are undone."""
    done = apply(rows)
    try:
        yield done
    finally:
        restore(done)
