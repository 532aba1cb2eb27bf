"""Tier: pure + a subprocess on the pinned wheel. The entry point does not run Megatron's ``make`` when the
wheel's prebuilt dataset helpers import; otherwise Megatron's own ``compile_helpers`` runs unchanged."""

import subprocess
import sys

import pytest

from megatron_ext.training import startup


def test_the_pinned_wheel_really_fails_megatrons_make():
    # The failure the skip exists for: the wheel has helpers_cpp but no Makefile, so make fails and
    # Megatron exits (status 1) from compile_helpers.
    code = "from megatron.core.datasets.utils import compile_helpers; compile_helpers()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert startup.prebuilt_helpers_available()


@pytest.fixture
def datasets_utils(monkeypatch):
    import megatron.core.datasets.utils as utils

    calls = []
    monkeypatch.setattr(utils, "compile_helpers", lambda: calls.append("make"))
    return utils, calls


def test_prebuilt_helpers_skip_make(datasets_utils):
    utils, calls = datasets_utils
    startup.skip_helpers_build_when_prebuilt()
    startup.skip_helpers_build_when_prebuilt()  # idempotent: wrapped once
    assert utils.compile_helpers() is None
    assert calls == []


def test_without_prebuilt_helpers_megatron_builds_them(datasets_utils, monkeypatch):
    utils, calls = datasets_utils
    startup.skip_helpers_build_when_prebuilt()
    monkeypatch.setattr(startup, "prebuilt_helpers_available", lambda: False)
    utils.compile_helpers()
    assert calls == ["make"]
