"""What importing some modules pulls in, seen from a fresh interpreter (the test process has
imported everything already).

Example::

    assert imported_from(["megatron_ext.moe.pad_routing"], ["megatron"]) == []
"""

import json
import subprocess
import sys
from collections.abc import Sequence


def imported_from(modules: Sequence[str], forbidden: Sequence[str]) -> list[str]:
    """The modules of the ``forbidden`` packages (each the package itself or below it) that a
    fresh interpreter holds after importing ``modules``; raises if an import fails."""
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
