"""Ending a process as the interpreter would, without its teardown (pure Python); and the
parent-death signal (Linux's ``PR_SET_PDEATHSIG``) that ends a process with the one that started it.

A finished ``--cpu`` rank spends its exit tearing down torch's and Megatron's objects; of that only
closing still-open files can be observed: :func:`exit_like_the_interpreter` does that, then exits.
"""

import atexit
import ctypes
import gc
import io
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

#: Linux's ``prctl`` option for the signal a process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """This process gets SIGKILL when the thread that forked it exits (Linux's ``PR_SET_PDEATHSIG``;
    call it in the child, right after the fork). Returns whether it armed (elsewhere: nothing)."""
    if not sys.platform.startswith("linux"):
        return False
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    return True


def die_with_the_agent(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """A rank started by torchrun's agent (``torchrun`` or ``python -m megatron_ext.launcher``)
    gets SIGKILL when the agent dies, so a ``kill -9`` of the launcher leaves no rank training
    unsupervised (Linux; elsewhere nothing). Returns whether it armed."""
    # The agent sets TORCHELASTIC_RUN_ID and LOCAL_RANK, and starts the rank from its main thread
    # (Popen): the signal comes when the agent process ends.
    if "TORCHELASTIC_RUN_ID" not in environ or "LOCAL_RANK" not in environ:
        return False
    agent = os.getppid()
    if not die_with_parent():
        return False
    # The agent died between the two reads: the rank was handed to another parent and no signal
    # will come; it kills itself as the signal would have.
    if os.getppid() != agent:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def reap_exited(children: dict[int, Any]) -> Iterator[tuple[Any, int]]:
    """Pops each child of ``children`` (pid -> what it serves) that has exited, without waiting,
    and yields what it served with its exit code (a signal's as minus its number)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:  # none has exited yet
            return
        yield children.pop(pid), os.waitstatus_to_exitcode(status)


def flush_c_streams() -> None:
    """``fflush(NULL)``: what C's ``exit()`` does and ``os._exit`` skips."""
    ctypes.CDLL(None).fflush(None)


#: The buffered file types ``open`` returns for writing (compared by exact type: an ``isinstance``
#: against ``io.IOBase`` over every object costs several times more).
_WRITABLE_FILE_TYPES = frozenset({io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom})


def flush_open_files() -> int:
    """Flushes the Python buffers of every file object still open for writing, as closing them at
    interpreter teardown would; returns how many were flushed."""
    # About 0.1 s in a rank that imported Megatron: one pass over the collector's objects. Errors
    # (a closed pipe) are ignored, as the interpreter ignores them at exit.
    flushed = 0
    for obj in gc.get_objects():
        if type(obj) in _WRITABLE_FILE_TYPES:
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
                    flushed += 1
            except (OSError, ValueError):
                pass
    return flushed


def exit_like_the_interpreter(code: int, interrupted: bool = False) -> None:
    """Interpreter exit in the order ``Py_FinalizeEx`` runs it, then ``os._exit(code)``
    (``interrupted``: on an uncaught KeyboardInterrupt, dying by SIGINT as the interpreter does).
    The kernel closes the descriptors; the caller destroys process groups before."""
    threading._shutdown()  # non-daemon threads are joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    flush_open_files()  # what closing them at teardown would write
    flush_c_streams()
    if interrupted:  # an uncaught KeyboardInterrupt ends the process by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)
