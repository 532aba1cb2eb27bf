"""Ranks forked from a server that imported Megatron once (for :func:`megatron_ext.testing.real_loop.launch`).

On the 2-core CI machine a fresh interpreter spends about 6 s importing ``megatron.training`` and
about 1.7 s tearing those modules down at exit, against well under a second for a tiny model's
training run. Forking each rank from a server process that holds the imports removes both.

What a forked rank runs is what a fresh interpreter runs: ``python -m MODULE ARGS`` (``runpy``, as
``-m`` does), with exactly the environment and working directory the launch gives it, stdin from
``/dev/null``, stdout and stderr appended to one output file, the exit handlers run at the end and
the exit status of ``SystemExit`` or of an uncaught exception. It differs in what happened at import
time, so the launcher forks only while the environment is the one the server imported under
(:func:`import_environment_differs`): a variable read at import (``HF_HUB_OFFLINE`` by
``huggingface_hub``, ``OMP_NUM_THREADS`` by OpenMP) then has the value a fresh rank would have
seen. Megatron's start clocks, set when its training module is imported, are reset to the rank's
start. Warnings raised while importing Megatron are not in the output (they were raised in the
server). Importing megatron_ext patches nothing (tests/test_cpu.py), so every rank starts unpatched.

The server (``python -m megatron_ext.testing.preloaded``) reads one JSON request per line on stdin,
forks, and writes ``started ID PID`` and, once the rank is reaped, ``exited PID STATUS`` on stdout.
It exits when its stdin closes, which happens when the process that started it exits.
"""

import atexit
import gc
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any

#: Modules the server imports: what every launch of ``megatron_ext.pretrain_gpt`` imports (the
#: tokenizer module brings in ``transformers``, a third of the time).
PRELOAD = (
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.core.models.gpt",
    "megatron.core.models.hybrid",
    "megatron.core.tokenizers.text.text_tokenizer",
    "megatron_ext.pretrain_gpt",
    "megatron_ext.training.dataset_provider",
    "megatron_ext.training.forward_step",
    "megatron_ext.training.run_state",
    "megatron_ext.moe.layer_specs",
    "megatron_ext.replay.route_recorder",
)
#: Variables that differ between launches and are read only at run time (torchrun's per-rank
#: environment, the rendezvous, pytest's current test).
RUN_TIME_VARIABLES = frozenset(
    {
        "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
        "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
        "PYTEST_CURRENT_TEST",
    }
)  # fmt: skip
#: What the server imports under, on top of the caller's environment (what launch gives every rank).
SERVER_ENVIRONMENT = {"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}


# ----------------------------------------------------------------------------- the server process


def serve() -> None:
    """The server's loop: preload, then fork one rank per request until stdin closes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import importlib

        for name in PRELOAD:
            importlib.import_module(name)
    gc.freeze()  # the ranks' garbage collector then leaves the preloaded objects' pages shared
    requests, replies = sys.stdin.buffer, sys.stdout
    replies.write("ready\n")
    replies.flush()
    pending = b""
    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        if ready:
            chunk = os.read(requests.fileno(), 1 << 16)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                replies.flush()  # nothing of the server's buffered output goes into the rank
                pid = os.fork()
                if pid == 0:  # the rank: never back into this loop
                    try:
                        run_module(**request["rank"])
                    finally:
                        os._exit(1)
                replies.write(f"started {request['id']} {pid}\n")
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            replies.write(f"exited {pid} {os.waitstatus_to_exitcode(status)}\n")
        replies.flush()


def run_module(module: str, args: list[str], env: dict[str, str], cwd: str, out: str) -> None:
    """In the forked rank: ``python -m module *args`` with ``env`` and ``cwd``, its output appended
    to ``out``; exits with the status a fresh interpreter would. Descriptors 0 and 1 are the
    server's pipes until they are replaced here."""
    started = time.time()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    fd = os.open(out, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # New streams on the redirected descriptors, buffered as a fresh interpreter's are.
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - they live as long as the rank
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path.insert(0, cwd)  # as ``python -m`` puts the working directory first
    sys.argv = [module, *args]
    # Megatron's start clocks (set when the server imported it) read the rank's start, as they
    # would in a fresh interpreter.
    training = sys.modules.get("megatron.training.training")
    if training is not None:
        training.set_startup_timestamps(program_start=started)
        training._LEGACY_TRAIN_START_TIME = started
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as an uncaught exception would be
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()  # what interpreter exit runs before tearing the modules down
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


# ----------------------------------------------------------------------------- the launcher's side


class _Client:
    """The launcher's end of one server: sends requests, collects started/exited lines."""

    def __init__(self) -> None:
        self.env = {**os.environ, **SERVER_ENVIRONMENT}
        # The server's own output (its import-time messages) is kept apart, for a failed start.
        self._log = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, env=self.env, text=True, bufsize=1,
        )  # fmt: skip
        if self._proc.stdout.readline().strip() != "ready":
            self._log.seek(0)
            raise RuntimeError(
                f"the preloaded launch server failed ({self._proc.wait()}):\n{self._log.read()}"
            )
        self._lock = threading.Condition()
        self._started: dict[int, int] = {}
        self._exited: dict[int, int] = {}
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True, name="launch-server-reader").start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            kind, key, value = line.split()
            with self._lock:
                if kind == "started":
                    self._started[int(key)] = int(value)
                    # A reused pid: the earlier rank's status (reported before this fork) is stale.
                    self._exited.pop(int(value), None)
                else:
                    self._exited[int(key)] = int(value)
                self._lock.notify_all()
        with self._lock:  # the server is gone: no rank will be reported again
            self._exited.setdefault(-1, -1)
            self._lock.notify_all()

    def start(self, rank: dict[str, Any]) -> int:
        with self._lock:
            request_id, self._next_id = self._next_id, self._next_id + 1
            self._proc.stdin.write(json.dumps({"id": request_id, "rank": rank}) + "\n")
            self._proc.stdin.flush()
            while request_id not in self._started:
                if -1 in self._exited:
                    raise RuntimeError("the preloaded launch server exited")
                self._lock.wait()
            return self._started.pop(request_id)

    def exit_status(self, pid: int, timeout: float | None = 0) -> int | None:
        with self._lock:
            self._lock.wait_for(lambda: pid in self._exited or -1 in self._exited, timeout)
            if pid not in self._exited and -1 in self._exited:
                raise RuntimeError("the preloaded launch server exited")
            return self._exited.get(pid)

    def alive(self) -> bool:
        return self._proc.poll() is None


_client: _Client | None = None
_client_lock = threading.Lock()


def _server() -> _Client:
    global _client
    with _client_lock:
        if _client is None or not _client.alive():
            _client = _Client()
        return _client


def import_environment_differs(env: dict[str, str]) -> list[str]:
    """The variables (other than :data:`RUN_TIME_VARIABLES`) whose value in ``env`` is not the one
    the server imported under (it is started on first use); empty when a forked rank sees what a
    fresh one would."""
    server_env = _server().env
    names = (set(env) | set(server_env)) - RUN_TIME_VARIABLES
    return sorted(n for n in names if env.get(n) != server_env.get(n))


class Rank:
    """One forked rank, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, module: str, args: list[str], env: dict[str, str], cwd: str, out: str):
        self._server = _server()
        rank = {"module": module, "args": args, "env": env, "cwd": cwd, "out": out}
        self.pid = self._server.start(rank)

    def poll(self) -> int | None:
        return self._server.exit_status(self.pid)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # exited in between; the server reaps it
                pass

    def wait(self, timeout: float | None = None) -> int:
        status = self._server.exit_status(self.pid, timeout)
        if status is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0)
        return status


if __name__ == "__main__":
    serve()
