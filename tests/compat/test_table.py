"""Tier: Megatron on one rank (the installed sources read). The table is consistent with Megatron:
every row applying on the installed megatron-core names something that exists, each function is
rebound by one row only, each :class:`HostTorch` row's function really makes a call the row replaces
and each line a row depends on is there (no stale rows), and each factory a row names resolves.
(Run under each supported version: ``make test-megatron-0.18.2`` runs this file on 0.18.2.)"""

import importlib

import pytest

from megatron_ext import compat
from megatron_ext.compat.host_torch import HostTorch
from megatron_ext.compat.patch import TESTED_MEGATRON, Needs, original, replaced_function
from megatron_ext.compat.span import lines_holding
from megatron_ext.compat.triage import rerouted_calls
from megatron_ext.compat.versions import table_version

pytestmark = pytest.mark.each_megatron

#: The rows applying on the installed megatron-core.
ROWS = [row for row in compat.TABLE if row.applies_on(table_version())]


def test_every_row_is_complete() -> None:
    names = [row.name for row in ROWS]
    assert len(ROWS) > 100  # the CPU stack alone has ~100 rows
    for row in compat.TABLE:
        assert row.versions and set(row.versions) <= set(TESTED_MEGATRON), row
        for version in row.versions:
            found = row.fingerprint_on(version)
            assert row.reason and (isinstance(found, Needs) or len(found) == 16), row
        assert row.module.startswith("megatron."), row
        assert row.replacement is not None or row.group in ("owned", "copied"), row
    for version in TESTED_MEGATRON:
        host = [r.name for r in compat.TABLE
                if isinstance(r.replacement, HostTorch) and r.applies_on(version)]  # fmt: skip
        assert len(host) == len(set(host)), f"a function rebound by two rows on {version}"
    assert set(compat.rows("cpu")) | set(compat.rows("cpu_loop")) <= set(ROWS)
    assert names.count("megatron.training.training.get_model") == 2  # rebound and wrapped


def test_a_row_applies_on_exactly_its_versions() -> None:
    """A row of some versions only (a function one version lacks) is applied, and checked, on
    those: megatron-core 0.18.2 has no FusedSharedExpertMLP, 0.19.2 no CUDA call in
    calc_params_l2_norm."""
    some = [row for row in compat.TABLE if set(row.versions) != set(TESTED_MEGATRON)]
    names = {row.attribute for row in some}
    assert {"FusedSharedExpertMLP.linear_fc1_forward_and_act", "calc_params_l2_norm"} <= names
    for row in some:
        for version in TESTED_MEGATRON:
            applied = row in compat.rows(row.group, version=version)
            assert applied == (version in row.versions), (row.name, version)


def test_every_host_row_replaces_a_call_its_function_makes() -> None:
    # The check's own reading (compat.triage), so what the check calls "still needed" is this.
    for row in ROWS:
        if isinstance(row.replacement, HostTorch):
            function = replaced_function(row, original(row))
            assert rerouted_calls(row, function), f"{row.name}: makes none of its row's calls"


def test_every_line_a_row_depends_on_is_there() -> None:
    rows = [row for row in ROWS if row.depends_on]
    assert len(rows) >= 5  # the launch rows that wrap a 700-line function narrow to their lines
    for row in rows:
        held = lines_holding(replaced_function(row, original(row)), row.depends_on)
        assert all(held.values()), (row.name, held)


def test_every_factory_resolves() -> None:
    for row in compat.TABLE:
        if isinstance(row.replacement, str):
            module, _, name = row.replacement.partition(":")
            assert callable(getattr(importlib.import_module(module), name)), row.replacement
