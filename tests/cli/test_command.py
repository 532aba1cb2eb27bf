"""Tier: pure (one fresh interpreter). ``megatron-ext``'s parser and ``--help`` import neither torch nor
Megatron, its own subcommands' and the tools' alike: a command's imports wait until it runs.

The probe builds the parser and prints the help of the command and of each of its own subcommands,
then imports the launcher the ``rehearse`` subcommand and the demo run (which imports no torch
either: its ranks and server import it), then the host-sync detector, and checks that the same probe
sees torch arrive there (so a probe that could not see a torch import fails instead of passing).
"""

import json
import subprocess
import sys

_PROBE = """
import contextlib, io, json, sys
from megatron_ext.cli.command import main
from megatron_ext.common.shipped_files import TOOL_SCRIPTS

TOOLS = [[name] for name in TOOL_SCRIPTS]
assert len(TOOLS) >= 5, TOOLS

seen = {}
for command in ([], ["bench"], ["demo"], ["flags"], ["rehearse"], *TOOLS):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            status = main([*command, "--help"])
        except SystemExit as exc:
            status = exc.code
        assert status in (0, None), (command, status)
    assert "usage: megatron-ext" in out.getvalue(), command
    seen[" ".join(command) or "megatron-ext"] = sorted(
        name for name in ("torch", "megatron") if name in sys.modules
    )
from megatron_ext.testing.real_loop import launch  # what `rehearse` runs
seen["after importing the launcher"] = sorted(
    name for name in ("torch", "megatron") if name in sys.modules
)
from megatron_ext.testing import assert_no_host_sync  # the sync detector: torch
seen["after importing the sync detector"] = sorted(
    name for name in ("torch", "megatron") if name in sys.modules
)
print(json.dumps(seen))
"""


def test_help_of_every_own_subcommand_imports_no_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen.pop("after importing the sync detector") == ["torch"]
    assert seen.pop("after importing the launcher") == []
    commands = ("megatron-ext", "bench", "demo", "flags", "rehearse", "preprocess-data",
                "convert-routes", "ingest-rollouts", "pack-stats", "make-corpus",
                "merge-datasets")  # fmt: skip
    assert seen == {name: [] for name in commands}
