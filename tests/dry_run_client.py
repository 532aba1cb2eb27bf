"""The executable half of tests/dry_run_server.py: what a dry run's ``python`` runs (with ``python
-SE``: no site-packages, no ``PYTHON*`` variables), so it imports only small standard modules.

It sends ``-m megatron_ext.pretrain_gpt ... --dry-run`` with its standard streams, environment and
working directory to the server when :func:`why_not_forked` finds nothing a fork would not
reproduce, and exits with the forked child's status; anything else it ``exec``s as written.
"""

import json
import os
import signal
import socket
import sys

#: The module whose dry runs are forked.
ENTRY = "megatron_ext.pretrain_gpt"
#: Flags that change what the entry does before Megatron's import: never forked.
PRE_IMPORT_FLAGS = ("--cpu", "--verbose", "--logging-level")
#: Variables bash sets or unsets in every command (a non-interactive one drops the prompts), read
#: by no import.
SHELL_VARIABLES = ("PWD", "OLDPWD", "SHLVL", "_", "PS1", "PS2")


def _real_python(shim: str, configured: str | None) -> str:
    """The interpreter the command names: ``configured``, or the next executable of the shim's
    name on ``PATH`` after the shim's own folder (it stands in for ``python3`` there)."""
    if configured:
        return configured
    name, own = os.path.basename(shim), os.path.realpath(os.path.dirname(shim))
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(folder or ".", name)
        if os.path.realpath(folder or ".") != own and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit(f"{name}: not found on PATH after {own}")


def why_not_forked(argv: list[str], env: dict[str, str], python: str, server: dict) -> str | None:
    """Why the command ``python *argv`` under ``env`` would not run as a fresh interpreter runs it
    if it were forked from ``server`` (its ``config``); None: it is forked."""
    if argv[:2] != ["-m", ENTRY]:
        return f"not -m {ENTRY}"
    if "--dry-run" not in argv:
        return "not a dry run"
    early = [f for f in PRE_IMPORT_FLAGS if any(a == f or a.startswith(f + "=") for a in argv)]
    if early:
        return f"{', '.join(early)}: the entry does more before Megatron's import"
    if python != server["python"]:
        return f"interpreter {python}, not the server's {server['python']}"
    before, after = server["start_env"], server["env"]
    names = (set(env) | set(before) | set(after)) - set(server["run_time"]) - set(SHELL_VARIABLES)
    differs = sorted(n for n in names if env.get(n) not in (before.get(n), after.get(n)))
    if differs:
        return f"import-time variables differ: {', '.join(differs)}"
    return None


def client_main(config_path: str) -> None:
    """The ``python`` executable's program: forward ``sys.argv[1:]`` to the server or ``exec`` the
    real interpreter with it (see the module docstring)."""
    argv = sys.argv[1:]
    with open(config_path) as f:
        config = json.load(f)
    python = _real_python(sys.argv[0], config["configured_python"])
    why = why_not_forked(argv, dict(os.environ), python, config)
    if argv[:2] == ["-m", ENTRY]:
        line = json.dumps({"argv": argv, "forked": why is None, "why": why}) + "\n"
        with open(config["records"], "a") as f:
            f.write(line)
    if why is not None:
        os.execv(python, [python, *argv])
    request = {"args": argv[2:], "env": dict(os.environ), "cwd": os.getcwd()}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(config["socket"])
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        reply = b""
        while chunk := conn.recv(64):
            reply += chunk
    code = int(reply.split()[-1]) if reply.startswith(b"exited ") else 1
    if code < 0:  # killed by a signal: so is this process, as the interpreter would have been
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)
