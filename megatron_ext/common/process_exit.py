"""Ending a process as the interpreter would, without its teardown (pure Python).

``Py_FinalizeEx`` joins non-daemon threads, runs ``atexit`` handlers, flushes the streams and then
tears down every module and object it holds. The last step is what a finished ``--cpu`` rank
spends its exit on (torch and Megatron hold tens of thousands of objects and hundreds of modules)
and nothing observable depends on it: files are closed and flushed by the kernel and ``atexit``,
process groups are already destroyed. :func:`exit_like_the_interpreter` runs the observable steps
in the interpreter's order and then ends the process with ``os._exit``.
"""

import atexit
import ctypes
import os
import signal
import sys
import threading


def flush_c_streams() -> None:
    """``fflush(NULL)``: what C's ``exit()`` does and ``os._exit`` skips."""
    ctypes.CDLL(None).fflush(None)


def exit_like_the_interpreter(code: int, interrupted: bool = False) -> None:
    """Interpreter exit in the order ``Py_FinalizeEx`` runs it, then ``os._exit(code)``.

    Args:
        code: The exit status.
        interrupted: The process ends on an uncaught KeyboardInterrupt: it then dies by SIGINT,
            as the interpreter makes it.
    """
    threading._shutdown()  # non-daemon threads are joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    flush_c_streams()
    if interrupted:  # an uncaught KeyboardInterrupt ends the process by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)
