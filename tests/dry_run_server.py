"""Dry runs forked from one interpreter that imported Megatron once, for the tests that run the
documented commands (tests/training/test_example_dry_runs.py, tests/training/test_doc_commands.py).

A documented launch under ``DRY_RUN=1`` ends in ``exec "$PYTHON" -m megatron_ext.pretrain_gpt ...
--dry-run``: a fresh interpreter that spends about 5 s of CPU importing Megatron for well under 2 s
of validation. :class:`DryRunServer` starts one server under the tests' environment (Transformer
Engine's stand-ins included) that imports what such a dry run imports, and writes a ``python``
executable (:attr:`DryRunServer.python`) to give the commands as their interpreter (``PYTHON``, or
``python3`` first on ``PATH``). That executable passes its standard streams, arguments, environment
and working directory to the server, which forks a child that runs ``python -m
megatron_ext.pretrain_gpt ...`` as the preloaded launch ranks do
(:func:`megatron_ext.rehearse.rank_server.run_as_main`: ``runpy``, the interpreter's exit), and
exits with the child's status. The script, its flags and everything after the imports are the
user's command's own code path.

Only what a fork reproduces is forked; anything else runs as written, the executable replacing
itself with the real interpreter (``exec``):

- the command is ``-m megatron_ext.pretrain_gpt ... --dry-run``, without ``--cpu``, ``--verbose``
  or ``--logging-level`` (each changes what the entry does before Megatron's import, which the
  server did once, as a plain dry run does it: :func:`serve`);
- the interpreter it names is the server's (``python3`` found on ``PATH`` after this executable's
  folder, when it stands in for one on ``PATH``);
- every environment variable has the value the server started under or the one its imports left,
  except the ``run_time`` ones the caller names (variables the scripts set, read after the imports).

What Megatron's imports print (Transformer Engine's stand-ins say which attributes they bound) is
printed by the server once, kept, and written first to each child's streams, where a fresh
interpreter would have printed it. Each command is recorded (:meth:`DryRunServer.records`: forked
or why not), so a test can assert that its dry runs were forked.

The executable's half is tests/dry_run_client.py (a few small standard modules, under ``python
-SE``: about 50 ms a command).
"""

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.dry_run_client import ENTRY

#: What the server imports: the modules every dry run of the entry imports (the model classes,
#: Megatron's training loop and arguments, the startup check, megatron_ext's checks), as they are
#: imported without ``--cpu`` (the tokenizer libraries with them). The entry itself is run as
#: ``__main__`` by each child, as ``-m`` runs it.
PRELOAD = (
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.arguments",
    "megatron.core.models.gpt",
    "megatron.core.models.hybrid",
    "megatron_ext.training.arguments",
    "megatron_ext.compat.check",
    "megatron_ext.training.dry_run",
    "megatron_ext.training.launch_rules",
    "megatron_ext.training.gpt_builder",
)
#: The checkout: what the executable imports its client from.
ROOT = Path(__file__).resolve().parents[1]
#: Seconds to wait for the server to import.
START_TIMEOUT = 300.0


# ----------------------------------------------------------------------------- the server process


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, new_fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if not chunk:
            raise ConnectionError("the client closed before its request")
        data += chunk
        fds += new_fds
    return json.loads(data), fds


def serve(config_path: str, socket_path: str, records: str, run_time: list[str],
          configured_python: str | None) -> None:  # fmt: skip
    """Imports what a dry run imports (after what the entry does first for a plain dry run: hide
    the known import warnings, Megatron's INFO logs unless a level is chosen), keeps what the
    imports printed, writes ``config_path`` once ready, and forks one child per connection. It
    dies with the process that started it (pytest), and its children with it."""
    import gc
    import importlib

    from megatron_ext.common.process_exit import die_with_parent, flush_c_streams, reap_exited
    from megatron_ext.common.quiet import quiet_warnings
    from megatron_ext.rehearse.rank_server import run_as_main
    from megatron_ext.training.launch_log import quiet_megatron_info

    die_with_parent()
    start_env = dict(os.environ)
    quiet_warnings()
    quiet_megatron_info(["--dry-run"], os.environ)
    printed: list[bytes] = []
    saved = [os.dup(1), os.dup(2)]
    captures = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    for fd, capture in zip((1, 2), captures, strict=True):
        os.dup2(capture.fileno(), fd)
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        flush_c_streams()
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)
    for capture in captures:
        capture.seek(0)
        printed.append(capture.read())
        capture.close()
    gc.freeze()  # the children's garbage collector then leaves the preloaded objects' pages shared

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    config = {
        "socket": socket_path, "records": records, "run_time": run_time,
        "python": sys.executable, "configured_python": configured_python,
        "start_env": start_env, "env": dict(os.environ),
    }  # fmt: skip
    with open(config_path + ".tmp", "w") as f:
        json.dump(config, f)
    os.replace(config_path + ".tmp", config_path)

    children: dict[int, socket.socket] = {}  # pid -> its client's connection, until reaped
    while True:
        ready, _, _ = select.select([listener, *children.values()], [], [], 0.05)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _recv_request(conn)
                except (ConnectionError, ValueError, OSError):
                    conn.close()
                    continue
                for stream in (sys.stdout, sys.stderr):  # nothing of the server's goes to a child
                    stream.flush()
                flush_c_streams()
                started = time.time()
                pid = os.fork()
                if pid == 0:  # the child: never back into this loop
                    try:
                        die_with_parent()
                        listener.close()
                        for other in [conn, *children.values()]:
                            other.close()
                        for target, fd in zip((0, 1, 2), fds, strict=True):
                            os.dup2(fd, target)
                            os.close(fd)
                        for fd, text in zip((1, 2), printed, strict=True):
                            if text:
                                os.write(fd, text)
                        run_as_main(ENTRY, request["args"], request["env"], request["cwd"], started)
                    except BaseException:  # noqa: BLE001 - a failure before the module ran
                        import traceback

                        traceback.print_exc()
                    finally:
                        os._exit(1)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
            else:  # a client's end closed before its child exited (the client was killed)
                pid = next(p for p, c in children.items() if c is sock)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for conn, code in reap_exited(children):
            try:
                conn.sendall(f"exited {code}\n".encode())
            except OSError:
                pass
            conn.close()


# ----------------------------------------------------------------------------- the tests' side


class DryRunServer:
    """One server started under the commands' environment, and its executable for them.

    Args:
        folder: Where the socket, the executable, the records and the server's log go.
        env: The commands' environment, less their ``run_time`` variables: the server's.
        run_time: Variables the commands may set to other values (the scripts' own: ``DATA``,
            ``WORLD_SIZE``, ...), none read by an import.
        python: The interpreter the commands name (``PYTHON=``:attr:`python`). None: the one
            named ``name`` on ``env``'s ``PATH``, for which the executable stands in there
            (:attr:`env` puts its folder first).
        name: The executable's file name.
        cwd: The commands' working directory (``-m`` imports from it first): the server's.
    """

    def __init__(
        self,
        folder: Path,
        env: dict[str, str],
        run_time: tuple[str, ...] = (),
        python: str | None = sys.executable,
        name: str = "python",
        cwd: str | Path = ROOT,
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.config = folder / "config.json"
        self.records_file = folder / "records.jsonl"
        self.records_file.touch()
        self.bin = folder / "bin"
        self.bin.mkdir(exist_ok=True)
        #: The executable to give the commands as their interpreter.
        self.python = self.bin / name
        #: The environment to run the commands under (``env``, the executable first on ``PATH``
        #: when it stands in for the interpreter found there).
        self.env = dict(env)
        interpreter = python
        if python is None:
            interpreter = shutil.which(name, path=env.get("PATH"))
            assert interpreter, f"no {name} on PATH={env.get('PATH')}"
            self.env["PATH"] = os.pathsep.join([str(self.bin), env.get("PATH", "")])
        socket_dir = tempfile.mkdtemp(prefix="dryrun_")  # a short path: AF_UNIX allows ~107 bytes
        self._socket = os.path.join(socket_dir, "s")
        self._log = open(folder / "server.log", "w")  # noqa: SIM115 - held while it runs
        argv = [
            interpreter, "-m", __name__, str(self.config), self._socket, str(self.records_file),
            json.dumps(list(run_time)), python or "",
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, env=self.env,
            cwd=cwd,
        )  # fmt: skip
        self.python.write_text(
            f"#!{sys.executable} -SE\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\n"
            f"from tests.dry_run_client import client_main\n"
            f"client_main({str(self.config)!r})\n"
        )
        self.python.chmod(0o755)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> "DryRunServer":
        """Waits for the server's imports; raises with its log if it failed."""
        deadline = time.monotonic() + timeout
        while not self.config.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(
                    f"the dry-run server failed ({self._proc.poll()}):\n"
                    + (self.folder / "server.log").read_text()[-3000:]
                )
            time.sleep(0.05)
        return self

    def records(self) -> list[dict[str, Any]]:
        """Each ``-m megatron_ext.pretrain_gpt`` command run so far: ``argv``, ``forked``, ``why``."""
        return [json.loads(line) for line in self.records_file.read_text().splitlines()]

    def close(self) -> None:
        """Stops the server (and any child still running: each dies with it)."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._log.close()
        if os.path.exists(self._socket):
            os.unlink(self._socket)
        os.rmdir(os.path.dirname(self._socket))

    def __enter__(self) -> "DryRunServer":
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5] or None)
