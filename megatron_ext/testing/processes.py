"""Processes for tests that kill a launcher or a tool and check that every process it started
ended too: which are still running (psutil; a zombie counts as ended: it runs nothing, and an
orphan's is reaped by whoever adopted it, if ever), and a program's ``main`` forked into a session
of its own, its exit status waited for with a bound::

    pid = fork_main(lambda: launcher.main(argv), tmp_path / "log")
    os.kill(pid, signal.SIGTERM)
    assert exit_status(pid, timeout=60) == 128 + signal.SIGTERM
    assert wait_ended(rank_pids, timeout=10) == []
"""

import contextlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import psutil


def running(pids: Iterable[int]) -> list[int]:
    """The processes of ``pids`` still running (not ended, not a zombie)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_ended(pids: Iterable[int], timeout: float) -> list[int]:
    """Waits up to ``timeout`` seconds for every process of ``pids`` to end; returns those still
    running then (empty: all ended)."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while (alive := running(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def in_session(sid: int) -> list[int]:
    """The running processes of session ``sid`` (a process started with ``start_new_session`` and
    everything it started that did not start a session of its own)."""
    pids = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid:
                pids.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return running(pids)


def fork_main(main: Callable[[], int], log: str | os.PathLike) -> int:
    """Forks this process to run ``main()`` as a program (a tool's, a launcher's) would run, for a
    test that signals it: in a session of its own (:func:`in_session` finds what it started), its
    standard output and error written to ``log``, ending with ``main``'s status (an uncaught
    exception: its traceback, status 1) without returning to the caller. Returns its pid.

    The fork keeps this process's imports: a test that imported Megatron starts a tool without the
    seconds a fresh interpreter spends importing it. Call it from the main thread.
    """
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: never back into the caller (pytest)
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        _rebind_closed_log_streams(sys.stderr)
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then status 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def _rebind_closed_log_streams(stream: Any) -> None:
    """Logging handlers the parent bound to a stream since closed (a module's handler created
    while pytest captured the output, as torch's elastic agent logger is at its first import)
    write to ``stream``, as a program's handlers would write to its standard error."""
    import logging

    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and getattr(
                handler.stream, "closed", False
            ):
                handler.stream = stream  # not setStream: it would flush the closed one


def exit_status(pid: int, timeout: float) -> int:
    """The exit status of child ``pid`` (a signal's: negative), waited for at most ``timeout``
    seconds; past it, everything in its session is killed and ``AssertionError`` raised (a hang)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    kill_session(pid)
    raise AssertionError(f"process {pid} hung: still running after {timeout} s (killed)")


def kill_session(sid: int) -> None:
    """SIGKILLs every process of session ``sid`` and reaps ``sid`` itself if it is a child."""
    for pid in in_session(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(sid, 0)
