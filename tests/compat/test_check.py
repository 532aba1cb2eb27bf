"""Tier: Megatron on one rank (its sources hashed in this process) and the entry in this process.

The startup check refuses an untested megatron-core version and a changed Megatron source, in one
line naming both, exit 2, unless ``--allow-untested-megatron``; the installed 0.19.2 passes.
"""

import dataclasses
import importlib
import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ext.compat import check
from megatron_ext.compat.patch import TESTED_MEGATRON, Patch, fingerprint
from megatron_ext.compat.table import TABLE
from megatron_ext.compat.versions import table_version

FUNCTION = '''def patched_function(x):
    """Doubles."""
    return x * 2  # a comment
'''


@pytest.mark.each_megatron
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
    row = Patch(group="launch", module="fake_megatron_module", attribute="patched_function",
                replacement=None, reason="test", fingerprint=fingerprint(module.patched_function))  # fmt: skip
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
    assert "megatron-core 0.20.0 is untested (tested: 0.18.2, 0.19.2)" in line
    # Between the tested versions too: 0.19.1 is not 0.18.2 or 0.19.2.
    assert "megatron-core 0.19.1 is untested" in (check.check_megatron(version="0.19.1") or "")


@pytest.mark.each_megatron
def test_each_version_is_checked_against_its_own_fingerprints() -> None:
    """The installed sources match the installed version's fingerprints (above) and not the other
    supported version's: the rows whose source differs between them are named, and a row of the
    installed version only (a function the other lacks) is not asked about for the other."""
    installed = check.installed_megatron()
    other = next(v for v in TESTED_MEGATRON if v != installed)
    line = check.check_megatron(version=other)
    assert line is not None and "is untested" not in line  # a tested version, other sources
    assert "megatron.core.transformer.moe.router.TopKRouter.__init__" in line, line
    only_installed = [r.name for r in TABLE if r.versions == (installed,)]
    assert only_installed and not any(name + "," in line + "," for name in only_installed)


def test_the_check_is_cheap() -> None:
    check.check_megatron()  # imports the modules once, as a launch does anyway
    started = time.perf_counter()
    check.check_megatron()
    elapsed = time.perf_counter() - started
    # ~0.07 s for the 112 rows on a shared 2-core machine (the spans read off code positions;
    # parsing each function with ast took ~2 s), 1.9 s with 40 processes on 2 cores before the
    # spans: the bound is for a check that reads whole files or tokenizes, not a benchmark.
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


def test_the_package_metadata_admits_the_tested_range_only() -> None:
    """The pin is the range from the oldest to the newest tested version; the startup check
    refuses the untested versions inside it (above)."""
    import tomllib

    from packaging.requirements import Requirement

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = [Requirement(d) for d in dependencies if d.startswith("megatron-core")]
    assert len(pins) == 1
    admitted = pins[0].specifier
    assert all(admitted.contains(version) for version in TESTED_MEGATRON)
    assert not any(admitted.contains(v) for v in ("0.17.1", "0.18.1", "0.19.3", "0.20.0"))


def _table_modules() -> list[str]:
    return sorted({row.module for row in TABLE})


def _bind_te_standins(monkeypatch) -> dict[str, list[str]]:
    """Every attribute of the table's modules that Megatron binds only where Transformer Engine
    imports, bound as on a GPU node (tests/compat/te_site)."""
    from tests.compat.te_site.sitecustomize import standin, te_bound_attributes

    bound = te_bound_attributes(_table_modules())
    for module, names in bound.items():
        for name in names:
            # raising=False: some are not bound at all without TE (Float8Tensor in torch.py).
            monkeypatch.setattr(importlib.import_module(module), name, standin(name), raising=False)
    return bound


ROPE = "megatron.core.models.common.embeddings.rope_utils"


def test_a_gpu_launch_with_transformer_engine_passes_the_startup_check(monkeypatch) -> None:
    """Where TE imports, Megatron binds its fused RoPE kernel (None here): the check asks what the
    row needs of it (a callable or None), not its source, and a GPU launch or dry run with TE is
    not refused. (Before: every such launch was refused, exit 2.)"""
    bound = _bind_te_standins(monkeypatch)
    # The interesting case occurred: the table's own row's attribute is now TE's kernel.
    assert "fused_apply_rotary_pos_emb" in bound[ROPE]
    assert callable(importlib.import_module(ROPE).fused_apply_rotary_pos_emb)
    assert {row.group for row in TABLE if row.name == f"{ROPE}.fused_apply_rotary_pos_emb"}
    for cpu, dry_run, cuda in [(False, False, True), (False, True, True), (False, True, False)]:
        groups = check.launch_groups(cpu=cpu, dry_run=dry_run, cuda=cuda, te=True)
        assert check.check_megatron(groups=groups) is None, groups
    assert check.check_megatron() is None  # every row, as python -m megatron_ext.compat.check


def test_a_value_that_is_not_what_its_row_needs_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(importlib.import_module(ROPE), "fused_apply_rotary_pos_emb", 3)
    line = check.check_megatron()
    assert line is not None and f"{ROPE}.fused_apply_rotary_pos_emb" in line
    assert check.found_fingerprint(check_row := next(
        r for r in TABLE if r.name == f"{ROPE}.fused_apply_rotary_pos_emb")) == "int"  # fmt: skip
    assert str(check_row.fingerprint) == "a callable or None"


def test_a_launch_checks_the_rows_it_applies() -> None:
    """A changed CPU row is named for a --cpu launch only: a GPU launch never applies it."""
    cpu_row = next(r for r in TABLE if r.group.startswith("cpu."))
    launch_row = next(r for r in TABLE if r.group == "launch")
    table = [dataclasses.replace(cpu_row, fingerprint="0" * 16),
             dataclasses.replace(launch_row, fingerprint="0" * 16)]  # fmt: skip
    gpu = check.launch_groups(cpu=False, dry_run=False, cuda=True, te=True)
    cpu = check.launch_groups(cpu=True, dry_run=False, cuda=False, te=False)
    assert check.changed_rows(table, gpu) == [launch_row.name]
    assert check.changed_rows(table, cpu) == [cpu_row.name, launch_row.name]
    assert "dry_run_target" in check.launch_groups(cpu=False, dry_run=True, cuda=False, te=False)
    assert "dry_run_target" not in check.launch_groups(cpu=False, dry_run=True, cuda=True, te=True)
    assert "validate_on_target" not in gpu and "cpu" not in gpu


@pytest.mark.each_megatron
def test_every_fingerprinted_row_is_megatron_defined_code() -> None:
    """Only Megatron's own functions and classes are fingerprinted; a row whose value comes from
    another package or may be absent (every TE-bound attribute the table touches) is checked by
    what it needs."""
    from megatron_ext.compat.patch import Needs, original
    from tests.compat.te_site.sitecustomize import te_bound_attributes

    te_bound = {f"{m}.{n}" for m, names in te_bound_attributes(_table_modules()).items()
                for n in names}  # fmt: skip
    for row in TABLE:
        if not row.applies_on(table_version()):  # a function the installed version lacks
            continue
        if row.name in te_bound:
            assert isinstance(row.fingerprint, Needs), row.name
        if isinstance(row.fingerprint, Needs):
            continue
        value = original(row)
        value = inspect.unwrap(getattr(value, "__func__", value))
        assert value.__module__.startswith("megatron."), (row.name, value.__module__)


def test_the_version_is_the_imported_megatrons_not_an_installed_distributions(tmp_path) -> None:
    """A Megatron-LM source checkout first on PYTHONPATH (its ``megatron/core/package_info.py``,
    no distribution metadata) is what the process imports: its version is reported, not the
    installed megatron-core wheel's, and a checkout's ``+<commit>`` suffix is not part of it.
    (Before: the distribution's metadata, so the wheel's 0.19.2, or a traceback without one.)"""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text(
        "VERSION = (0, 20, 0, 'rc1')\n__version__ = '0.20.0rc1+0123abc'\n"
    )
    probe = "from megatron_ext.compat.check import installed_megatron; print(installed_megatron())"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{root}"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0.20.0rc1"
    assert check.installed_megatron() in TESTED_MEGATRON  # this process: the Megatron it imports
