"""What importing some modules pulls in, seen from a fresh interpreter (the test process has
imported everything already).

Each question is answered by a child forked from one probe interpreter that imported only torch
and numpy (what the pure modules may import): a fresh state per question without a fresh
interpreter's seconds of importing torch. A question that forbids one of those is asked of a
fresh interpreter instead.

Example::

    assert imported_from(["megatron_ext.moe.pad_routing"], ["megatron"]) == []
"""

import atexit
import json
import subprocess
import sys
from collections.abc import Sequence

#: The probe interpreter: prints the modules it holds, then answers one JSON question per line,
#: each in a child forked for it (so no question sees another's imports).
_SERVER = r"""
import importlib, json, os, sys
import numpy, torch
print(json.dumps(sorted(sys.modules)), flush=True)
for line in sys.stdin:
    question = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            for name in question["modules"]:
                importlib.import_module(name)
            held = [m for m in sys.modules
                    if any(m == p or m.startswith(p + ".") for p in question["forbidden"])]
            answer = {"found": sorted(held)}
        except BaseException as err:
            answer = {"error": repr(err)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
"""

_probe: tuple[subprocess.Popen, set[str]] | None = None


def _server() -> tuple[subprocess.Popen, set[str]]:
    global _probe
    if _probe is None or _probe[0].poll() is not None:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        _probe = (proc, set(json.loads(proc.stdout.readline())))
        atexit.register(proc.stdin.close)
    return _probe


def _fresh(modules: Sequence[str], forbidden: Sequence[str]) -> list[str]:
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        f"forbidden = {list(forbidden)!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules"
        " if any(m == p or m.startswith(p + '.') for p in forbidden))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.splitlines()[-1])


def imported_from(modules: Sequence[str], forbidden: Sequence[str]) -> list[str]:
    """The modules of the ``forbidden`` packages (each the package itself or below it) that a
    fresh interpreter holds after importing ``modules``; raises if an import fails."""
    proc, preloaded = _server()
    if any(m == p or m.startswith(p + ".") for m in preloaded for p in forbidden):
        return _fresh(modules, forbidden)  # the probe holds what is forbidden: ask afresh
    proc.stdin.write(json.dumps({"modules": list(modules), "forbidden": list(forbidden)}) + "\n")
    proc.stdin.flush()
    answer = json.loads(proc.stdout.readline())
    if "error" in answer:
        raise ImportError(f"importing {list(modules)}: {answer['error']}")
    return answer["found"]
