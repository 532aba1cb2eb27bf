"""Tier: unit (and one server start). ``megatron_ext.testing.preloaded``: what the launcher's side makes
of the server's reports, and which environments it forks ranks under."""

import io
import threading
import types

from megatron_ext.testing import preloaded


def _client_reading(lines: str) -> preloaded._Client:
    """A client whose server printed ``lines`` and exited (no process behind it)."""
    client = object.__new__(preloaded._Client)
    client._proc = types.SimpleNamespace(stdout=io.StringIO(lines))
    client._lock = threading.Condition()
    client._started, client._exited = {}, {}
    client._read()
    return client


def test_a_reused_pid_does_not_report_the_earlier_ranks_exit():
    # Rank A (pid 5) exits 3; rank B is forked later with the same pid and is still running.
    client = _client_reading("started 0 5\nexited 5 3\nstarted 1 5\n")
    assert client._started == {0: 5, 1: 5}
    assert 5 not in client._exited  # B's status is unknown, not A's 3
    assert client._exited == {-1: -1}  # the server's end is recorded too


def test_an_exit_reported_after_its_start_is_kept():
    client = _client_reading("started 0 7\nexited 7 0\nstarted 1 8\nexited 8 -15\n")
    assert client._exited == {7: 0, 8: -15, -1: -1}


def test_only_the_import_time_environment_decides():
    server_env = preloaded._server().env
    same = {**server_env, "RANK": "1", "MASTER_PORT": "1", "PYTEST_CURRENT_TEST": "x"}
    assert preloaded.import_environment_differs(same) == []
    changed = {**server_env, "HF_HUB_OFFLINE": "0" if server_env.get("HF_HUB_OFFLINE") else "1"}
    assert preloaded.import_environment_differs(changed) == ["HF_HUB_OFFLINE"]
    assert "OMP_NUM_THREADS" in preloaded.import_environment_differs(
        {k: v for k, v in server_env.items() if k != "OMP_NUM_THREADS"}
    )
    assert server_env["OMP_NUM_THREADS"] == "1"  # what launch gives every rank
