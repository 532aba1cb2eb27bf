"""Shared pytest setup: keep Megatron's jit fusers from compiling on CPU and fix thread counts; the
wheel installed in a fresh venv and the demo run once from it (tests/installed_wheel.py), for every
test that reads them."""

import os

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """This checkout's wheel in a fresh venv (:func:`tests.installed_wheel.install_wheel`)."""
    from tests.installed_wheel import install_wheel

    return install_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def wheel_demo(installed, tmp_path_factory):
    """The demo as ``megatron-ext demo`` runs it from the installed wheel (one run per session)."""
    from tests.installed_wheel import run_demo

    return run_demo(installed, tmp_path_factory.mktemp("demo"))
