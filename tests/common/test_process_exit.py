"""A process ended by exit_like_the_interpreter shows what a normal interpreter exit shows: its
non-daemon threads finish, atexit handlers run, Python and C buffers reach the file (a file left
open included), the status is the one given, and an interrupt still ends it by SIGINT."""

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent(
    """
    import atexit, ctypes, sys, threading, time
    from megatron_ext.common.process_exit import exit_like_the_interpreter

    out = open(sys.argv[1], "a")
    left_open = open(sys.argv[1] + ".open", "w")  # never closed nor flushed by the program
    left_open.write("kept")
    def late():
        time.sleep(0.2)
        out.write("thread\\n")
    threading.Thread(target=late).start()
    atexit.register(lambda: (out.write("atexit\\n"), out.flush()))
    sys.stdout.write("python-buffered")  # no newline, no flush
    ctypes.CDLL(None).printf(b"c-buffered")  # stdout is a file: C buffers it
    exit_like_the_interpreter(int(sys.argv[2]), interrupted=sys.argv[3] == "1")
    """
)


def _run(tmp_path: Path, code: int, interrupted: bool) -> tuple[subprocess.CompletedProcess, str]:
    log = tmp_path / f"log{code}{interrupted}"
    stdout = tmp_path / f"stdout{code}{interrupted}"
    with open(stdout, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-c", PROGRAM, str(log), str(code), "1" if interrupted else "0"],
            stdout=f, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=60,
        )  # fmt: skip
    kept = (tmp_path / f"log{code}{interrupted}.open").read_text()
    return proc, log.read_text() + "|" + stdout.read_text() + "|" + kept


def test_threads_atexit_and_both_buffers_finish_and_the_status_is_kept(tmp_path):
    proc, seen = _run(tmp_path, 3, interrupted=False)
    assert proc.returncode == 3, proc.stderr
    logged, printed, kept = seen.split("|")
    assert logged == "thread\natexit\n"  # the thread joined before the handlers ran
    assert "python-buffered" in printed and "c-buffered" in printed
    assert kept == "kept"  # a file left open keeps what was written to it, as at teardown


def test_an_interrupt_ends_the_process_by_sigint(tmp_path):
    proc, seen = _run(tmp_path, 1, interrupted=True)
    assert proc.returncode == -signal.SIGINT, proc.stderr
    assert seen.startswith("thread\natexit\n")


def test_reap_exited_pops_only_the_children_that_exited_with_their_codes() -> None:
    """An exit status and a kill are reported as the interpreter reports them; a running child
    stays in the mapping, and nothing blocks while it runs."""
    import os
    import signal
    import time

    from megatron_ext.common.process_exit import reap_exited

    def child(body) -> int:
        pid = os.fork()
        if pid == 0:
            try:
                body()
            finally:
                os._exit(3)
        return pid

    exits = child(lambda: None)
    killed = child(lambda: time.sleep(60))
    running = child(lambda: time.sleep(60))
    os.kill(killed, signal.SIGKILL)
    children = {exits: "exits", killed: "killed", running: "running"}
    reaped: dict[str, int] = {}
    deadline = time.monotonic() + 30
    while len(reaped) < 2 and time.monotonic() < deadline:
        reaped.update(reap_exited(children))
        time.sleep(0.01)
    try:
        assert reaped == {"exits": 3, "killed": -signal.SIGKILL}
        assert children == {running: "running"}
        assert dict(reap_exited(children)) == {}  # still running: returns at once
    finally:
        os.kill(running, signal.SIGKILL)
        os.waitpid(running, 0)
