"""Ranks forked from a server that imported Megatron once (for :func:`megatron_ext.rehearse.local_launch.launch`).

On the 2-core CI machine a fresh interpreter spends about 6 s importing ``megatron.training`` and
about 1.7 s tearing those modules down at exit, against well under a second for a tiny model's
training run. Forking each rank from a server process that holds the imports removes both.

What a forked rank runs is what a fresh interpreter runs: ``python -m MODULE ARGS`` (``runpy``, as
``-m`` does; MODULE itself is not preloaded), and its exit is the interpreter's: the message of
``SystemExit`` or ``sys.excepthook`` on an uncaught exception, then non-daemon threads joined, exit
handlers run, Python's and C's streams flushed. Its standard streams are the interpreter's own
objects (built under the same environment, so buffered and encoded as a fresh rank's) on the
launch's descriptors: stdin from ``/dev/null``, stdout and stderr appended to one output file.

It differs in what happened at import time, so the launcher forks only while the caller's
environment is the one the server started under, or the one its imports left
(:func:`import_environment_differs`, torchrun's per-rank variables aside): a variable read at
import (``HF_HUB_OFFLINE`` by ``huggingface_hub``, ``OMP_NUM_THREADS`` by OpenMP) then has the
value a fresh rank would have seen. The rank's environment is the server's after its imports
(``TORCHINDUCTOR_CACHE_DIR``, which Megatron's import sets, included) with the launch's per-rank
variables. Also reset in the rank, as a fresh one has them: Megatron's start clocks (set at its
import) and numpy's global random state. Left as they are, and documented: warnings raised while
importing go to the server's log, and every forked rank shares the server's string-hash seed
(fresh ranks each draw one), so set iteration order agrees across ranks; the examples' tests, which
run them under torchrun's fresh interpreters, keep that case covered. Importing megatron_ext patches
nothing (tests/cpu/test_model_stack.py), so every rank starts unpatched.

Protocol (on two pipes of their own, so nothing printed can corrupt it): the launcher writes one
JSON request per line, ``{"id", "rank": {...}}`` to start a rank or ``{"id", "signal"}`` to
signal one; the server answers ``ready ENV``, ``started ID PID`` and, once the rank is reaped,
``exited ID STATUS``. Statuses are keyed by request id and the server sends the signals, so a
reused pid can neither report nor receive anything. The server kills its ranks and exits when the
request pipe closes (when the process that started it exits), and each rank dies with the server.
"""

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
from typing import Any

from megatron_ext.common.process_exit import (
    die_with_parent,
    exit_like_the_interpreter,
    flush_c_streams,
    reap_exited,
)
from megatron_ext.rehearse.rank_env import rank_env

#: Modules the server imports: what every launch of ``megatron_ext.pretrain_gpt`` imports (its
#: tokenizer libraries deferred, as a ``--cpu`` launch has them), and megatron_ext's own modules
#: that every ``--cpu`` launch imports (a dry run's: its checks; a training run's: data, loss,
#: save; about 0.1 s of CPU a rank, most of it compiling their source). Not the entry module
#: itself: ``runpy`` runs it as ``__main__``.
PRELOAD = (
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.arguments",
    "megatron.core.models.gpt",
    "megatron.core.models.hybrid",
    "megatron.core.tokenizers.text.text_tokenizer",
    "megatron_ext.training.arguments",
    "megatron_ext.training.dataset_provider",
    "megatron_ext.training.forward_step",
    "megatron_ext.training.run_state",
    "megatron_ext.moe.layer_specs",
    "megatron_ext.replay.route_recorder",
    # megatron_ext's, every --cpu launch (a dry run too)
    "megatron_ext.common.quiet",
    "megatron_ext.common.thd_partition",
    "megatron_ext.cpu.caching_malloc",
    "megatron_ext.cpu.training_loop",
    "megatron_ext.data.data_args",
    "megatron_ext.training.checkpoint_checks",
    "megatron_ext.training.cpu_args",
    "megatron_ext.training.cpu_rehearsal",
    "megatron_ext.training.dry_run",
    "megatron_ext.training.eval_args",
    "megatron_ext.training.gpt_builder",
    "megatron_ext.training.launch_log",
    "megatron_ext.training.launch_rules",
    "megatron_ext.training.model_provider",
    "megatron_ext.training.resume_checks",
    "megatron_ext.training.sft_args",
    "megatron_ext.training.vocab_check",
    # megatron_ext's, every --cpu training run
    "megatron_ext.common.token_positions",
    "megatron_ext.data.batch",
    "megatron_ext.data.provider",
    "megatron_ext.replay.keyed_router_replay",
    "megatron_ext.replay.layout",
    "megatron_ext.replay.shared_directory",
    "megatron_ext.training.checkpoint_save",
    "megatron_ext.training.loss_log",
)
#: Variables that differ between launches and are read only at run time: the per-rank
#: environment launch gives (torchrun's, with the rendezvous) and pytest's current test.
RUN_TIME_VARIABLES = frozenset(rank_env(0, 1, "0")) | {"PYTEST_CURRENT_TEST"}
#: What the server starts under, on top of the caller's environment (what launch gives every rank).
SERVER_ENVIRONMENT = {"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
#: Seconds to wait for the server to fork a rank.
START_TIMEOUT = 60.0


# ----------------------------------------------------------------------------- the server process


def serve(requests_fd: int, replies_fd: int) -> None:
    """The server's loop: preload, then fork one rank per request until the request pipe closes."""
    import importlib

    from megatron_ext.training.startup import defer_tokenizer_libraries

    defer_tokenizer_libraries()  # as a --cpu launch does: no transformers unless a rank asks
    for name in PRELOAD:
        importlib.import_module(name)
    compute_once_for_every_rank()
    gc.freeze()  # the ranks' garbage collector then leaves the preloaded objects' pages shared
    os.write(replies_fd, f"ready {json.dumps(dict(os.environ))}\n".encode())
    live: dict[int, int] = {}  # pid -> request id, until reaped
    pending = b""
    while True:
        ready, _, _ = select.select([requests_fd], [], [], 0.05)
        if ready:
            chunk = os.read(requests_fd, 1 << 16)
            if not chunk:  # the launcher is gone: so are its ranks
                for pid in live:
                    os.kill(pid, signal.SIGKILL)
                for pid in live:
                    os.waitpid(pid, 0)
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if "signal" in request:  # not yet reaped, so the pid is still the rank's
                    pid = next((p for p, i in live.items() if i == request["id"]), None)
                    if pid is not None:
                        os.kill(pid, request["signal"])
                    continue
                for stream in (sys.stdout, sys.stderr):  # nothing of the server's goes to the rank
                    stream.flush()
                flush_c_streams()
                pid = os.fork()
                if pid == 0:  # the rank: never back into this loop
                    try:
                        os.close(requests_fd)
                        os.close(replies_fd)
                        run_module(**request["rank"])  # exits
                    except BaseException:  # noqa: BLE001 - a failure before the module ran
                        import traceback

                        traceback.print_exc()
                    finally:
                        os._exit(1)
                live[pid] = request["id"]
                os.write(replies_fd, f"started {request['id']} {pid}\n".encode())
        for request_id, code in reap_exited(live):
            os.write(replies_fd, f"exited {request_id} {code}\n".encode())


def compute_once_for_every_rank() -> None:
    """Two pure computations every rank repeats, done once in the server (about 0.7 s of CPU per
    rank of the ~1.7 s a tiny forked launch costs, by ``cProfile`` of one): the renamed code of the
    compatibility rows a ``--cpu`` launch applies (the CPU model stack's, the training loop's and
    the validation on the target's: :func:`megatron_ext.compat.patch.prepare`, computed, not
    installed, so ranks still start unpatched; the loop's alone cost each rank about 0.15 s), and
    the field docstrings Megatron's parser reads
    from each config dataclass for argparse's help on every ``parse_args`` (``inspect.getsource``
    and ``ast.parse`` of the class). The second is a memo on Megatron's
    ``ArgumentGroupFactory._get_field_docstrings`` in this server only: each call gets a copy of
    what the unmemoized method returned for that class (tests/rehearse/test_rank_server.py compares
    them), so every help text and parsed value is unchanged.
    """
    import argparse

    from megatron.training import argument_utils, arguments

    from megatron_ext import compat
    from megatron_ext.compat.check import launch_groups
    from megatron_ext.compat.patch import prepare

    prepare(compat.rows(*launch_groups(cpu=True, dry_run=False)))
    factory = argument_utils.ArgumentGroupFactory
    read = factory._get_field_docstrings
    memo: dict[type, dict[str, str]] = {}

    def field_docstrings(self: Any, src_cfg_class: type) -> dict[str, str]:
        if src_cfg_class not in memo:
            memo[src_cfg_class] = read(self, src_cfg_class)  # its recursion comes back here
        return dict(memo[src_cfg_class])

    field_docstrings.__wrapped__ = read  # type: ignore[attr-defined]
    field_docstrings.memo = memo  # type: ignore[attr-defined]
    factory._get_field_docstrings = field_docstrings
    arguments.add_megatron_arguments(argparse.ArgumentParser())  # reads every class once


def run_module(module: str, args: list[str], env: dict[str, str], cwd: str, out: str) -> None:
    """In the forked rank: ``python -m module *args`` with ``env`` and ``cwd``, its output appended
    to ``out``; exits as a fresh interpreter would (see the module's docstring)."""
    started = time.time()
    die_with_parent()  # the server is single-threaded: safe here
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    fd = os.open(out, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    run_as_main(module, args, env, cwd, started)


def run_as_main(
    module: str, args: list[str], env: dict[str, str], cwd: str, started: float
) -> None:
    """The part of :func:`run_module` after the standard streams are in place (also the forked dry
    runs of tests/dry_run_server.py): ``python -m module *args`` with ``env``
    and ``cwd``, Megatron's start clocks at ``started``; exits as a fresh interpreter would."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[0] = cwd  # as ``python -m`` puts the working directory first
    sys.argv = [module, *args]
    if "numpy" in sys.modules:  # a fresh interpreter seeds it from the OS
        sys.modules["numpy"].random.seed()
    training = sys.modules.get("megatron.training.training")
    if training is not None:  # Megatron's start clocks, set at its import: the rank's start
        training._TRAIN_START_TIME = training._LEGACY_TRAIN_START_TIME = started
    code, interrupted = 0, False
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
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 1, True
    except BaseException:  # noqa: BLE001 - reported as an uncaught exception is
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_like_the_interpreter(code, interrupted)


# ----------------------------------------------------------------------------- the launcher's side


class _Client:
    """The launcher's end of one server: sends requests, collects started/exited reports."""

    def __init__(self) -> None:
        self.start_env = {**os.environ, **SERVER_ENVIRONMENT}
        # The server's own output (import-time messages and warnings) is kept apart.
        self._log = tempfile.TemporaryFile("w+")
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(requests_r), str(replies_w)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, env=self.start_env,
            pass_fds=(requests_r, replies_w),
        )  # fmt: skip
        os.close(requests_r)
        os.close(replies_w)
        self._requests = os.fdopen(requests_w, "w", buffering=1)
        self._replies = os.fdopen(replies_r, "r")
        ready = self._replies.readline()
        if not ready.startswith("ready "):
            self._log.seek(0)
            raise RuntimeError(
                f"the preloaded launch server failed ({self._proc.wait()}):\n{self._log.read()}"
            )
        #: The server's environment after its imports (what the ranks start from).
        self.env: dict[str, str] = json.loads(ready[len("ready ") :])
        self._lock = threading.Condition()
        self._started: dict[int, int] = {}
        self._exited: dict[int, int] = {}
        self._gone = False
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True, name="launch-server-reader").start()

    def _read(self) -> None:
        try:
            for line in self._replies:
                kind, request_id, value = line.split()
                with self._lock:
                    target = self._started if kind == "started" else self._exited
                    target[int(request_id)] = int(value)
                    self._lock.notify_all()
        finally:
            with self._lock:  # whatever ended the stream, no rank will be reported again
                self._gone = True
                self._lock.notify_all()

    def _send(self, request: dict[str, Any]) -> None:
        self._requests.write(json.dumps(request) + "\n")

    def start(self, rank: dict[str, Any]) -> int:
        """Forks a rank; returns its request id."""
        with self._lock:
            request_id, self._next_id = self._next_id, self._next_id + 1
            self._send({"id": request_id, "rank": rank})
            if not self._lock.wait_for(
                lambda: request_id in self._started or self._gone, START_TIMEOUT
            ):
                raise RuntimeError(
                    f"the preloaded launch server forked nothing in {START_TIMEOUT} s"
                )
            if request_id not in self._started:
                raise RuntimeError("the preloaded launch server exited")
            return request_id

    def signal(self, request_id: int, sig: int) -> None:
        with self._lock:
            if request_id not in self._exited and not self._gone:
                self._send({"id": request_id, "signal": int(sig)})

    def exit_status(self, request_id: int, timeout: float | None = 0) -> int | None:
        with self._lock:
            self._lock.wait_for(lambda: request_id in self._exited or self._gone, timeout)
            if request_id not in self._exited and self._gone:
                raise RuntimeError("the preloaded launch server exited (its ranks with it)")
            return self._exited.get(request_id)

    def alive(self) -> bool:
        return not self._gone and self._proc.poll() is None


_client: _Client | None = None
_client_lock = threading.Lock()


def _server() -> _Client:
    global _client
    with _client_lock:
        if _client is None or not _client.alive():
            _client = _Client()
        return _client


def warm_up() -> None:
    """Starts the server in the background, so that its imports overlap what the caller does
    next (the demo's preprocessing); the first launch then waits for it only as long as it still
    imports. A server that fails to start is started again, and its error raised, by that launch."""

    def start() -> None:
        try:
            _server()
        except Exception:  # noqa: BLE001 - raised again by the launch that needs the server
            pass

    threading.Thread(target=start, daemon=True, name="launch-server-warm-up").start()


def import_environment_differs(env: dict[str, str]) -> list[str]:
    """The variables (other than :data:`RUN_TIME_VARIABLES`) whose value in ``env`` is neither the
    one the server started under nor the one its imports left (it is started on first use); empty
    when a forked rank sees what a fresh one would."""
    server = _server()
    before, after = server.start_env, server.env
    names = (set(env) | set(before) | set(after)) - RUN_TIME_VARIABLES
    return sorted(n for n in names if env.get(n) not in (before.get(n), after.get(n)))


class Rank:
    """One forked rank, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, module: str, args: list[str], env: dict[str, str], cwd: str, out: str):
        if not os.path.isdir(cwd):  # as Popen would, before anything starts
            raise FileNotFoundError(f"no such directory: {cwd!r}")
        self._server = _server()
        environment = {k: v for k, v in self._server.env.items() if k not in RUN_TIME_VARIABLES}
        environment.update({k: v for k, v in env.items() if k in RUN_TIME_VARIABLES})
        rank = {"module": module, "args": args, "env": environment, "cwd": cwd, "out": out}
        self._id = self._server.start(rank)

    def poll(self) -> int | None:
        return self._server.exit_status(self._id)

    def terminate(self) -> None:
        self._server.signal(self._id, signal.SIGTERM)

    def kill(self) -> None:
        self._server.signal(self._id, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        status = self._server.exit_status(self._id, timeout)
        if status is None:
            raise subprocess.TimeoutExpired(f"rank {self._id}", timeout or 0)
        return status


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
