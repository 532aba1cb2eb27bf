"""Tier: subprocesses (gloo ranks, no Megatron run). ``megatron_ext.rehearse.local_launch.launch`` without
torchrun's agent: each rank gets torchrun's environment, one output stream comes back, and the first
rank to fail stops the others as the agent would (a peer left waiting for it would hang). Both ways
to start a rank: forked from the server that imported Megatron once (the default) and a fresh
interpreter; the fork is used only while the environment is the one the server started under or
the one its imports left."""

import os
import re
import subprocess
import time

import pytest

from megatron_ext.rehearse import rank_server as preloaded
from megatron_ext.rehearse.local_launch import launch

PROBE = "tests.testing.launch_probe"


#: A variable read at import, for all the launch knows: set, it keeps ranks from being forked.
IMPORT_TIME = "MEGATRON_EXT_LAUNCH_PROBE"


@pytest.mark.parametrize("preload", [True, False], ids=["forked", "fresh"])
def test_ranks_get_torchruns_environment_and_one_output(preload):
    """Fresh: started so by an import-time variable the server did not start under (the launch
    would fork them otherwise; ``preload=False`` is the failing-rank and exit tests' way)."""
    env = {} if preload else {IMPORT_TIME: "1"}
    assert IMPORT_TIME not in os.environ
    differs = preloaded.import_environment_differs({**os.environ, **env})  # the server is up
    assert differs == sorted(env)  # before the clock
    launched_at = time.time()
    run = launch(["pass"], nproc=2, module=PROBE, timeout=120, env=env)
    assert run.returncode == 0, run.output
    assert run.preloaded is preload and run.not_forked_because == sorted(env)
    for rank in (0, 1):
        assert f"rank {rank} of 2 local {rank}" in run.output
        assert f"rank {rank} passed the barrier" in run.output
    draws = re.findall(r"rank \d numpy draw (\d+)", run.output)
    assert len(set(draws)) == 2, draws  # each rank's own random state, as fresh ones have
    starts = re.findall(r"rank \d preloaded, Megatron's start time ([0-9.]+)", run.output)
    if preload:  # Megatron was imported before the rank ran; its start clock is the rank's
        assert len(starts) == 2 and all(float(s) >= launched_at for s in starts), run.output
    else:
        assert starts == [] and "preloaded" not in run.output


@pytest.mark.parametrize("preload", [True, False], ids=["forked", "fresh"])
def test_a_failing_rank_stops_the_one_waiting_for_it(preload, tmp_path):
    start = time.monotonic()
    run = launch(["fail", str(tmp_path)], nproc=2, module=PROBE, timeout=120, preload=preload)
    assert run.preloaded is preload
    assert run.returncode == 3, run.output  # the failing rank's code, not the stopped one's
    assert "rank 0 joining" in run.output and "rank 0 of 2" not in run.output
    assert time.monotonic() - start < 60  # stopped, not left to gloo's 30-minute timeout


def test_an_uncaught_exception_exits_1_with_its_traceback_when_forked():
    run = launch(["raise"], nproc=2, module=PROBE, timeout=120)
    assert run.preloaded and run.returncode == 1
    assert "Traceback (most recent call last):" in run.output
    assert re.search(r"ValueError: rank [01] raised", run.output), run.output


def test_a_timeout_stops_the_ranks_and_keeps_what_they_printed():
    """Rank 0 of 2, started alone, waits in the rendezvous for rank 1 until the timeout stops it;
    the ``TimeoutExpired`` carries what it printed (``rehearse --log-dir`` writes it)."""
    with pytest.raises(subprocess.TimeoutExpired) as err:
        launch(["pass"], nproc=2, ranks=(0,), module=PROBE, timeout=3)
    assert "rank 0 joining" in err.value.output and "rank 0 of 2" not in err.value.output


def test_a_forked_rank_exits_as_a_fresh_interpreter_does():
    """Same output, byte for byte, and status: the message, the thread joined, the exit handler,
    every stream flushed, in the interpreter's order."""
    forked, fresh = (
        launch(["exit"], nproc=1, module=PROBE, timeout=120, preload=p) for p in (True, False)
    )
    assert forked.preloaded and not fresh.preloaded
    assert forked.returncode == fresh.returncode == 1
    for line in ("unflushed print", "a line to stderr", "thread finished", "exit handler ran",
                 "exit message"):  # fmt: skip
        assert line in fresh.output, fresh.output
    assert forked.output == fresh.output


def test_a_missing_working_directory_fails_before_any_rank_starts(tmp_path):
    with pytest.raises(FileNotFoundError):
        launch(["pass"], nproc=2, module=PROBE, timeout=120, cwd=tmp_path / "missing")
