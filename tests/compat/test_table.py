"""Tier: Megatron on one rank (the installed sources read). The table is consistent with Megatron:
every row names something that exists, each function is rebound by one row only, and each
:class:`HostTorch` row's function really makes a call the row replaces (no stale rows)."""

import importlib
import inspect
import re

from megatron_ext import compat
from megatron_ext.compat.host_torch import HostTorch, innermost_function
from megatron_ext.compat.patch import TESTED_MEGATRON, Needs, original


def test_every_row_is_complete() -> None:
    names = [row.name for row in compat.TABLE]
    assert len(compat.TABLE) > 100  # the CPU stack alone has ~100 rows
    for row in compat.TABLE:
        assert row.reason and (isinstance(row.fingerprint, Needs) or len(row.fingerprint) == 16), row
        assert row.checked_on == TESTED_MEGATRON, row
        assert row.module.startswith("megatron."), row
        assert row.replacement is not None or row.group in ("owned", "copied"), row
    host = [r.name for r in compat.TABLE if isinstance(r.replacement, HostTorch)]
    assert len(host) == len(set(host)), "a function rebound by two rows"
    assert set(compat.rows("cpu")) | set(compat.rows("cpu_loop")) <= set(compat.TABLE)
    assert names.count("megatron.training.training.get_model") == 2  # rebound and wrapped


def test_every_host_row_replaces_a_call_its_function_makes() -> None:
    for row in compat.TABLE:
        host = row.replacement
        if not isinstance(host, HostTorch):
            continue
        module = importlib.import_module(row.module)
        body = inspect.getsource(innermost_function(original(row), module.__file__))
        code = "\n".join(line.split("#")[0] for line in body.splitlines())
        calls = [n for n in host.cuda if re.search(rf"torch\.cuda\.{n}\b", code)]
        factories = host.factories and "cuda" in re.sub(r"torch\.cuda\.\w+", "", code)
        assert calls or factories, f"{row.name}: makes none of the calls its row replaces"
