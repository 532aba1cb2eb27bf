"""Tier: unit (and one server start). ``megatron_ext.rehearse.rank_server``: what the launcher's side makes
of the server's reports, and which environments it forks ranks under."""

import io
import threading
import types

import pytest

from megatron_ext.rehearse import rank_server as preloaded


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


def test_only_the_import_time_environment_decides(monkeypatch):
    before = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}  # what the server started under
    after = {**before, "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"}  # what its imports left
    server = types.SimpleNamespace(start_env=before, env=after)
    monkeypatch.setattr(preloaded, "_server", lambda: server)
    differs = preloaded.import_environment_differs
    assert differs({**before, "RANK": "1", "MASTER_PORT": "1", "PYTEST_CURRENT_TEST": "x"}) == []
    assert differs(after) == []  # a caller that imported Megatron itself still forks
    assert differs({**before, "HF_HUB_OFFLINE": "1"}) == ["HF_HUB_OFFLINE"]
    assert differs({"PATH": "/bin"}) == ["OMP_NUM_THREADS"]
    assert differs({**after, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}) == [
        "TORCHINDUCTOR_CACHE_DIR"
    ]


def test_the_real_server_starts_under_launchs_environment():
    server = preloaded._server()
    assert server.start_env["OMP_NUM_THREADS"] == "1"  # what launch gives every rank
    assert server.start_env["TORCHDYNAMO_DISABLE"] == "1"
    assert server.env["OMP_NUM_THREADS"] == "1"  # and what the ranks start from


def test_warm_up_starts_one_server_in_the_background_that_the_next_launch_uses(monkeypatch):
    started, release = [], threading.Event()

    class SlowClient:  # a server whose imports take until `release`
        def __init__(self):
            started.append(self)
            release.wait(10)

        def alive(self):
            return True

    monkeypatch.setattr(preloaded, "_Client", SlowClient)
    monkeypatch.setattr(preloaded, "_client", None)
    preloaded.warm_up()  # returns at once: the caller goes on while the server imports
    assert not release.is_set()
    got = []
    waiter = threading.Thread(target=lambda: got.append(preloaded._server()))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not got  # the launch waits for the warming server ...
    release.set()
    waiter.join(10)
    assert len(started) == 1 and got == started  # ... and uses it: one server, not two


def test_a_warm_up_that_fails_leaves_the_error_to_the_launch(monkeypatch):
    attempts = []

    def failing():
        attempts.append(1)
        raise RuntimeError("the preloaded launch server failed (1)")

    monkeypatch.setattr(preloaded, "_Client", failing)
    monkeypatch.setattr(preloaded, "_client", None)
    preloaded.warm_up()
    for _ in range(100):
        if attempts:
            break
        threading.Event().wait(0.05)
    with pytest.raises(RuntimeError, match="server failed"):
        preloaded._server()
    assert len(attempts) == 2


def test_what_the_server_computes_once_is_what_each_rank_would_compute():
    """The server's memo of Megatron's field docstrings gives each call a copy equal to Megatron's
    unmemoized method, for every config dataclass its parser reads; the renamed code of the rows
    a --cpu launch applies (model stack, training loop) is computed there and none of the rows is
    installed (a forked rank starts unpatched)."""
    import json

    from megatron_ext.testing.real_loop import launch

    run = launch([], nproc=1, module="tests.testing.server_probe", timeout=120)
    assert run.returncode == 0 and run.preloaded, run.output[-3000:]
    [line] = [line for line in run.output.splitlines() if line.startswith("PROBE ")]
    probe = json.loads(line[len("PROBE ") :])
    assert probe["classes"] >= 10 and probe["fields"] >= 500, probe  # the parser read them
    assert probe["same"] and probe["copies"], probe
    assert probe["renamed"] >= 120 and probe["applied"] == [], probe  # 73 without the loop rows
