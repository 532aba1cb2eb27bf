"""Tier: Megatron on one rank (the installed sources read). The table is consistent with Megatron:
every row names something that exists, each function is rebound by one row only, each
:class:`HostTorch` row's function really makes a call the row replaces and each line a row depends
on is there (no stale rows), and each factory a row names resolves."""

import importlib

from megatron_ext import compat
from megatron_ext.compat.host_torch import HostTorch
from megatron_ext.compat.patch import TESTED_MEGATRON, Needs, original, replaced_function
from megatron_ext.compat.span import lines_holding
from megatron_ext.compat.triage import rerouted_calls


def test_every_row_is_complete() -> None:
    names = [row.name for row in compat.TABLE]
    assert len(compat.TABLE) > 100  # the CPU stack alone has ~100 rows
    for row in compat.TABLE:
        assert row.reason and (isinstance(row.fingerprint, Needs) or len(row.fingerprint) == 16)
        assert row.checked_on == TESTED_MEGATRON, row
        assert row.module.startswith("megatron."), row
        assert row.replacement is not None or row.group in ("owned", "copied"), row
    host = [r.name for r in compat.TABLE if isinstance(r.replacement, HostTorch)]
    assert len(host) == len(set(host)), "a function rebound by two rows"
    assert set(compat.rows("cpu")) | set(compat.rows("cpu_loop")) <= set(compat.TABLE)
    assert names.count("megatron.training.training.get_model") == 2  # rebound and wrapped


def test_every_host_row_replaces_a_call_its_function_makes() -> None:
    # The check's own reading (compat.triage), so what the check calls "still needed" is this.
    for row in compat.TABLE:
        if isinstance(row.replacement, HostTorch):
            function = replaced_function(row, original(row))
            assert rerouted_calls(row, function), f"{row.name}: makes none of its row's calls"


def test_every_line_a_row_depends_on_is_there() -> None:
    rows = [row for row in compat.TABLE if row.depends_on]
    assert len(rows) >= 5  # the launch rows that wrap a 700-line function narrow to their lines
    for row in rows:
        held = lines_holding(replaced_function(row, original(row)), row.depends_on)
        assert all(held.values()), (row.name, held)


def test_every_factory_resolves() -> None:
    for row in compat.TABLE:
        if isinstance(row.replacement, str):
            module, _, name = row.replacement.partition(":")
            assert callable(getattr(importlib.import_module(module), name)), row.replacement
