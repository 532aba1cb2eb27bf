"""Shared pytest setup: keep Megatron's jit fusers from compiling on CPU and fix thread counts; fork
gloo workers from one preloaded server; give each test the session's environment back; the wheel
installed in a fresh venv and the demo run once from it (tests/installed_wheel.py), for every test
that reads them."""

import os

import pytest

from megatron_ext.testing.distributed import fork_workers_from_server

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A pool rebuilt after a failure test, or fresh for a benchmark's allocator halves, then costs a
# fork, not seconds of imports per rank (tests/testing/test_distributed.py runs the spawn path).
fork_workers_from_server()


#: The environment the session started under (after the two defaults above).
SESSION_ENVIRONMENT = dict(os.environ)


def _restore_session_environment() -> None:
    for name in set(os.environ) - set(SESSION_ENVIRONMENT) - {"PYTEST_CURRENT_TEST"}:
        del os.environ[name]
    for name, value in SESSION_ENVIRONMENT.items():
        if name != "PYTEST_CURRENT_TEST" and os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def session_environment():
    """Each test starts and ends under the session's environment. Entries run in this process set
    variables: Megatron's ``validate_args`` the ``NVTE_*_ATTN`` ones, ``--cpu``
    ``CUDA_DEVICE_MAX_CONNECTIONS``, a tokenizer directory ``HF_HUB_OFFLINE``; a module- or
    session-scoped fixture sets them before this fixture runs, so the session's own snapshot is put
    back, not the test's. ``launch`` forks ranks only under the environment its preloaded server
    started under (megatron_ext/testing/preloaded.py); one such leftover made every later launch
    of the session start fresh interpreters (seconds of imports per rank)."""
    _restore_session_environment()
    yield
    _restore_session_environment()


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
