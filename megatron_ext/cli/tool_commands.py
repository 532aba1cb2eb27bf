"""``megatron-ext preprocess-data|convert-routes|ingest-rollouts|pack-stats|make-corpus|merge-datasets ...``: the tools as subcommands.

Each runs the tool script's own ``main()`` as ``python tools/<tool>.py ARGS`` would::

    megatron-ext preprocess-data --input docs.jsonl --output-prefix data/corpus --append-eod
"""

import argparse
import runpy
import sys

from megatron_ext.common.shipped_files import TOOL_SCRIPTS, shipped_file
from megatron_ext.data.tool_errors import run_tool


def add_tool_commands(sub: argparse._SubParsersAction) -> None:
    """Lists the tool subcommands in ``megatron-ext --help`` (their arguments are the tools' own)."""
    for command, script in TOOL_SCRIPTS.items():
        sub.add_parser(command, add_help=False, help=f"tools/{script} (see its --help)")


def tool_command(argv: list[str]) -> int | None:
    """Runs the tool ``argv`` names (its first non-option word) and returns its exit status.

    Options before the tool's name (``--debug``, ``--verbose``) are passed on to the tool, which takes
    them too. Returns ``None`` if ``argv`` names no tool.
    """
    words = [i for i, arg in enumerate(argv) if not arg.startswith("-")]
    if not words or argv[words[0]] not in TOOL_SCRIPTS:
        return None
    at = words[0]
    command = argv[at]
    # The script itself, in the checkout or the wheel: its --help, one-line errors and exit status 2
    # are then the tool's own, not a copy of them.
    script = shipped_file("tools", TOOL_SCRIPTS[command])
    # Loaded under its own name, not "__main__": the subcommand then does what the script's
    # ``if __name__ == "__main__": sys.exit(run_tool(main))`` does, with this command as its name.
    tool = runpy.run_path(str(script), run_name=f"megatron_ext._tools.{script.stem}")
    # The tool's argparse reads sys.argv; its prog shows as "megatron-ext <command>".
    saved = sys.argv
    sys.argv = [f"megatron-ext {command}", *argv[:at], *argv[at + 1 :]]
    try:
        return run_tool(tool["main"])
    finally:
        sys.argv = saved
