"""Tier: processes with real signals. ``python -m megatron_ext.launcher`` (torchrun's agent in that
process) stopped by SIGTERM or SIGINT: every rank ends and one line says so, exit 128 + the signal;
killed by SIGKILL: a real ``megatron_ext.pretrain_gpt`` rank dies with it (its parent-death
signal), where it trained on unsupervised.

The launcher's ``main`` runs in a child forked from this process (torch imported: its 2 s import
skipped), in a session of its own. The signal tests' ranks are a stand-in script (what is tested is
the launcher's supervision); the SIGKILL test's rank is the real entry, stopped (SIGSTOP) once it
printed its first line, so that it cannot end by itself: only a signal that kills it can end it
then. The failed-rank exit status is tested by tests/training/test_launch_log.py.
"""

import contextlib
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from megatron_ext import launcher
from megatron_ext.rehearse.rank_env import free_port
from megatron_ext.testing.processes import exit_status, fork_main, kill_session, wait_ended
from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS

TIMEOUT_S = 60
#: The stand-in rank: says it started (a file), then would run for longer than a test.
STAND_IN = "import os, sys, time\nopen(sys.argv[1] + os.environ['RANK'], 'w').close()\n" \
    "time.sleep(120)\n"  # fmt: skip


def _launch(argv: list[str], log: Path) -> int:
    """The forked launcher's pid."""
    return fork_main(lambda: launcher.main(["--master-port", str(free_port()), *argv]), log)


def _wait_for(ready, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not in {TIMEOUT_S} s"
        time.sleep(0.05)


def _ranks(pid: int, nproc: int) -> list[int]:
    """The launcher's rank processes, once all ``nproc`` have started."""
    _wait_for(lambda: len(psutil.Process(pid).children()) == nproc, f"{nproc} ranks started")
    return [child.pid for child in psutil.Process(pid).children()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_every_rank_and_prints_one_line(sig, tmp_path) -> None:
    """torchrun printed an 11-frame SignalException traceback (SIGTERM) and passed SIGINT on to
    the ranks (a KeyboardInterrupt traceback from each); both exited 1."""
    script = tmp_path / "rank.py"
    script.write_text(STAND_IN)
    started, log = tmp_path / "started", tmp_path / "launcher.log"
    pid = _launch(["--nproc-per-node", "2", str(script), str(started)], log)
    try:
        ranks = _ranks(pid, 2)
        _wait_for(lambda: all(Path(f"{started}{r}").exists() for r in (0, 1)), "ranks running")
        os.kill(pid, sig)
        status = exit_status(pid, TIMEOUT_S)
        assert wait_ended(ranks, timeout=10) == []
        output = log.read_text()
        assert status == 128 + sig, output
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
        # torchrun's start banner aside (no per-rank "closing signal" line: one line in all)
        printed = [line for line in output.splitlines() if "distributed/run.py" not in line]
        assert printed == [f"launcher: {script} stopped by {sig.name}: every rank was stopped"]
    finally:
        kill_session(pid)


def test_a_real_rank_dies_with_a_killed_launcher(tmp_path) -> None:
    """``kill -9`` of the launcher: its ranks trained on unsupervised (and wrote checkpoints)."""
    log = tmp_path / "launcher.log"
    pid = _launch([
        "--nproc-per-node", "1", "-m", "megatron_ext.pretrain_gpt", *TINY_MOE_TEST_ARGS,
        "--expert-model-parallel-size", "1", "--mock-data", "--train-iters", "100000",
    ], log)  # fmt: skip
    rank = None
    try:
        (rank,) = _ranks(pid, 1)
        # Its first line (--cpu, before Megatron's import) comes after the parent-death signal is
        # armed, first thing in the entry.
        _wait_for(lambda: "megatron_ext: --cpu" in log.read_text(), "the rank's first line")
        os.kill(rank, signal.SIGSTOP)
        os.kill(pid, signal.SIGKILL)
        assert exit_status(pid, TIMEOUT_S) == -signal.SIGKILL
        assert wait_ended([rank], timeout=10) == []
    finally:
        kill_session(pid)
        if rank is not None:  # a session of its own (torchrun's): killed by pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, signal.SIGKILL)
