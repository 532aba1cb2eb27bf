"""Tier: Megatron on one rank (its sources hashed in this process) and the entry in this process.

The startup check refuses an untested megatron-core version and a changed Megatron source, in one
line naming both, exit 2, unless ``--allow-untested-megatron``; the installed 0.19.2 passes.
"""

import dataclasses
import importlib
import sys
import time

import pytest

from megatron_ext.compat import check
from megatron_ext.compat.patch import TESTED_MEGATRON, Patch, fingerprint
from megatron_ext.compat.table import TABLE

FUNCTION = '''def patched_function(x):
    """Doubles."""
    return x * 2  # a comment
'''


def test_the_installed_megatron_is_the_tested_one() -> None:
    # Positive control for the refusals below: every row matches the installed source.
    assert check.installed_megatron() in TESTED_MEGATRON
    assert check.changed_rows() == []
    assert check.check_megatron() is None


def test_a_wrong_fingerprint_is_refused_naming_the_row() -> None:
    row = next(r for r in TABLE if r.attribute == "Router.gating")
    wrong = dataclasses.replace(row, fingerprint="0" * 16)
    line = check.check_megatron(table=[TABLE[0], wrong])
    assert line is not None and "\n" not in line
    assert "megatron.core.transformer.moe.router.Router.gating" in line
    assert TABLE[0].name not in line  # only what changed is named


def test_an_edited_source_is_refused_and_layout_is_not(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "fake_megatron_module.py"
    path.write_text(FUNCTION)
    module = importlib.import_module("fake_megatron_module")
    row = Patch("launch", "fake_megatron_module", "patched_function", None, "test",
                fingerprint(module.patched_function))  # fmt: skip
    assert check.changed_rows([row]) == []
    # Indentation, blank lines and comment lines are not code: the fingerprint stays.
    path.write_text(
        "\n" + FUNCTION.replace("    return", "    # why\n\n    return").replace("    ", "\t")
    )
    importlib.reload(module)
    assert check.changed_rows([row]) == []
    path.write_text(FUNCTION.replace("x * 2", "x * 3"))
    importlib.reload(module)
    assert check.changed_rows([row]) == ["fake_megatron_module.patched_function"]
    del sys.modules["fake_megatron_module"]


def test_an_untested_version_is_refused_naming_found_and_tested() -> None:
    line = check.check_megatron(version="0.20.0")
    assert line is not None and "\n" not in line
    assert "megatron-core 0.20.0 is untested (tested: 0.19.2)" in line


def test_the_check_is_cheap() -> None:
    check.check_megatron()  # imports the modules once, as a launch does anyway
    started = time.perf_counter()
    check.check_megatron()
    elapsed = time.perf_counter() - started
    # 0.1-0.2 s for the 114 rows here, 1.9 s with 40 processes on 2 cores: the bound is for a
    # check that reads whole files or tokenizes (seconds even when idle), not a benchmark.
    assert elapsed < 5.0, elapsed


@pytest.mark.parametrize("allow", [False, True])
def test_the_entry_refuses_with_exit_2_unless_allowed(allow, monkeypatch, capsys) -> None:
    from tests.training.entry_args import dry_run_main

    monkeypatch.setattr(check, "installed_megatron", lambda: "0.20.0")
    flags = ["--mock-data", "--eval-interval", "1000"]
    flags += ["--allow-untested-megatron"] if allow else []
    status = dry_run_main(flags, monkeypatch)
    out = capsys.readouterr()
    if allow:  # past the check: the dry run validates and reports as usual
        assert status == 0, out.err[-2000:]
        assert "dry run OK" in out.out
    else:
        assert status == 2
        assert out.err.count("\n") == 1 and "megatron-core 0.20.0 is untested" in out.err, out.err
        assert "--allow-untested-megatron" in out.err


def test_the_package_metadata_allows_exactly_the_tested_versions() -> None:
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = [d.replace(" ", "") for d in dependencies if d.startswith("megatron-core")]
    assert pins == [f"megatron-core=={version}" for version in TESTED_MEGATRON]
