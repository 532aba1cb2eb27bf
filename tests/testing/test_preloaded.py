"""Tier: unit (and one server start). ``megatron_ext.testing.preloaded``: what the launcher's side makes
of the server's reports, and which environments it forks ranks under."""

import io
import threading

import pytest

from megatron_ext.testing import preloaded


def _client_reading(lines: str) -> preloaded._Client:
    """A client whose server wrote ``lines`` and then closed its end (no process behind it)."""
    client = object.__new__(preloaded._Client)
    client._replies = io.StringIO(lines)
    client._lock = threading.Condition()
    client._started, client._exited, client._gone = {}, {}, False
    return client


def test_statuses_are_keyed_by_request_not_pid():
    # Rank 0 (pid 5) exits 3; rank 1 is forked later with the same pid and is still running.
    client = _client_reading("started 0 5\nexited 0 3\nstarted 1 5\n")
    client._read()
    assert client._started == {0: 5, 1: 5} and client._exited == {0: 3}
    assert client.exit_status(0) == 3
    with pytest.raises(RuntimeError, match="exited"):  # rank 1's status is unknown, not 3
        client.exit_status(1)


def test_a_garbled_report_marks_the_server_gone_instead_of_hanging():
    client = _client_reading("started 0 5\nsomething else\n")
    with pytest.raises(ValueError):
        client._read()
    assert client._gone
    with pytest.raises(RuntimeError, match="exited"):
        client.exit_status(0, timeout=None)  # returns at once, not never


def test_only_the_import_time_environment_decides():
    server = preloaded._server()
    before, after = server.start_env, server.env
    same = {**before, "RANK": "1", "MASTER_PORT": "1", "PYTEST_CURRENT_TEST": "x"}
    assert preloaded.import_environment_differs(same) == []
    changed = {**before, "HF_HUB_OFFLINE": "0" if before.get("HF_HUB_OFFLINE") else "1"}
    assert preloaded.import_environment_differs(changed) == ["HF_HUB_OFFLINE"]
    assert "OMP_NUM_THREADS" in preloaded.import_environment_differs(
        {k: v for k, v in before.items() if k != "OMP_NUM_THREADS"}
    )
    assert before["OMP_NUM_THREADS"] == "1"  # what launch gives every rank
    # What the server's imports set (Megatron sets TORCHINDUCTOR_CACHE_DIR) counts as the same
    # with or without it: a caller that imported Megatron itself still forks.
    set_by_imports = sorted(set(after) - set(before))
    assert set_by_imports, "the imports set no variable: nothing to check"
    assert preloaded.import_environment_differs(after) == []
    assert preloaded.import_environment_differs(before) == []
