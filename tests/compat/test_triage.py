"""Tier: pure (small modules written here, read as the check reads Megatron), and Megatron on one
rank (the check's output for a row of the real table).

A row fingerprints the narrowest span that matters to it: a HostTorch row the statements of its
function that touch CUDA, a row that depends on lines the statements holding them. An edit
elsewhere in the function leaves the fingerprint; an edit of those statements, or a new CUDA call,
changes it. For a changed row, the check says whether what it replaces is still there.
"""

import dataclasses
import importlib
import itertools
import sys

import pytest

from megatron_ext.compat import check
from megatron_ext.compat.host_torch import HostTorch
from megatron_ext.compat.patch import Patch, original, row_fingerprint
from megatron_ext.compat.table import TABLE
from megatron_ext.compat.triage import triage

# Line numbers (the file's): step's synchronize on 7, its factory's device on 9.
SOURCE = '''import torch


def step(x):
    """Steps."""
    y = x * 2
    torch.cuda.synchronize()
    flags = torch.zeros(
        1, device="cuda"
    )
    return y + flags


def other(x):
    return x


class Box:
    def fill(self):
        return torch.cuda.current_device()
'''

_names = itertools.count()


@pytest.fixture
def load(tmp_path, monkeypatch):
    """Writes a source as a new module (a name of its own: no stale bytecode or line cache)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    loaded = []

    def write(source: str) -> str:
        name = f"fake_megatron_{next(_names)}"
        (tmp_path / f"{name}.py").write_text(source)
        importlib.import_module(name)
        loaded.append(name)
        return name

    yield write
    for name in loaded:
        sys.modules.pop(name, None)


def _row(module: str, attribute: str = "step", **kwargs) -> Patch:
    fields = dict(group="cpu_loop.training", module=module, attribute=attribute,
                  replacement=HostTorch(cuda=("synchronize",), factories=True), reason="test",
                  fingerprint="")  # fmt: skip
    row = Patch(**{**fields, **kwargs})
    return dataclasses.replace(row, fingerprint=row_fingerprint(row, original(row)))


def _changed(before: Patch, after_module: str) -> bool:
    moved = dataclasses.replace(before, module=after_module)
    return check.changed_rows([moved]) == [moved.name]


def test_an_edit_outside_the_cuda_statements_keeps_a_host_row_fingerprint(load) -> None:
    row = _row(load(SOURCE))
    assert not _changed(row, load(SOURCE.replace("x * 2", "x * 3").replace('"""Steps."""', "")))
    assert not _changed(row, load(SOURCE.replace("    y = x * 2\n", "    y = x * 2\n    z = 1\n")))
    # The other line of the factory's call is in the span: the statement, not just the line.
    assert _changed(row, load(SOURCE.replace("1, device", "2, device")))
    assert _changed(row, load(SOURCE.replace("synchronize()", "synchronize(0)")))
    # A new CUDA call anywhere in the function, rerouted or not, is in the span.
    new_call = SOURCE.replace("    return y + flags", "    torch.cuda.empty_cache()\n    return y")
    assert _changed(row, load(new_call))


def test_a_whole_function_row_changes_with_any_edit(load) -> None:
    row = _row(load(SOURCE), replacement="megatron_ext.compat.host_torch:rebind")
    assert _changed(row, load(SOURCE.replace("x * 2", "x * 3")))


def test_a_row_depending_on_a_line_fingerprints_its_statement(load) -> None:
    source = SOURCE.replace("    return y + flags", "    sys.exit()\n    return y + flags")
    row = _row(load(source), replacement="megatron_ext.compat.host_torch:rebind",
               depends_on=("sys.exit()",))  # fmt: skip
    assert not _changed(row, load(source.replace("x * 2", "x * 3")))
    assert _changed(row, load(source.replace("sys.exit()", "sys.exit(1)")))
    assert str(triage(row)) == "still needed: `sys.exit()` (line 11)"
    gone = dataclasses.replace(row, module=load(SOURCE))
    assert triage(gone).verdict == "gone" and "holds none of `sys.exit()`" in str(triage(gone))


def test_a_host_row_still_needed_names_its_calls_and_the_new_ones(load) -> None:
    row = _row(load(SOURCE))
    assert str(triage(row)) == 'still needed: torch.cuda.synchronize (line 7), "cuda" (line 9)'
    new_call = SOURCE.replace("    return y + flags", "    torch.cuda.empty_cache()\n    return y")
    assert str(triage(dataclasses.replace(row, module=load(new_call)))) == (
        'still needed: torch.cuda.synchronize (line 7), "cuda" (line 9); '
        "not rerouted: torch.cuda.empty_cache (line 11)"
    )


def test_a_call_moved_to_another_function_is_moved(load) -> None:
    row = _row(load(SOURCE), replacement=HostTorch(cuda=("synchronize",)))
    moved = SOURCE.replace("    torch.cuda.synchronize()\n", "").replace(
        "    return x\n", "    torch.cuda.synchronize()\n    return x\n"
    )
    verdict = triage(dataclasses.replace(row, module=load(moved)))
    assert verdict.verdict == "moved", verdict
    assert "now in other: torch.cuda.synchronize" in verdict.detail
    # Another row already covers that function: the call is not this row's any more.
    module = load(moved)
    covering = dataclasses.replace(row, module=module, attribute="other")
    verdict = triage(dataclasses.replace(row, module=module), [covering])
    assert verdict.verdict == "gone", verdict


def test_a_method_moved_out_of_its_class_is_moved(load) -> None:
    row = _row(load(SOURCE), attribute="Box.fill", replacement=HostTorch(cuda=("current_device",)))
    unboxed = SOURCE.replace(
        "class Box:\n    def fill(self):\n        return", "def fill():\n    return"
    )
    verdict = triage(dataclasses.replace(row, module=(module := load(unboxed))))
    assert str(verdict) == (
        f"moved: to {module}.fill (still holds torch.cuda.current_device (line 19))"
    )


def test_a_function_gone_with_its_calls_is_gone(load) -> None:
    row = _row(load(SOURCE), replacement=HostTorch(cuda=("synchronize",)))
    without = SOURCE.replace("    torch.cuda.synchronize()\n", "")
    verdict = triage(dataclasses.replace(row, module=load(without)))
    assert str(verdict) == (
        "gone: the function is there but makes none of torch.cuda.synchronize: the row can go"
    )
    renamed = without.replace("def step(", "def walk(")
    assert triage(dataclasses.replace(row, module=load(renamed))).verdict == "gone"


def test_the_check_prints_each_changed_rows_triage(monkeypatch, capsys) -> None:
    """The real table's Router.gating row, its fingerprint wrong: the check says the call is still
    there, in one line under the row's."""
    row = next(r for r in TABLE if r.attribute == "Router.gating")
    monkeypatch.setattr(check, "TABLE", (TABLE[0], dataclasses.replace(row, fingerprint="0" * 16)))
    assert check.main([]) == 1
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("changed"))
    assert row.name in lines[at] and "checked 0000000000000000" in lines[at]
    assert lines[at + 1].strip().startswith("still needed: torch.cuda.current_device (line")
    assert lines[-1] == "1 row(s) changed: 1 still needed"
