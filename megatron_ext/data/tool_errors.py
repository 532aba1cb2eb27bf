"""One-line errors for the command-line tools (``tools/*.py``): exit status 2, no traceback.

A tool's ``main(argv)`` raises ``ValueError`` for bad input and lets ``OSError`` through;
:func:`run_tool` prints either as one line, like argparse's own usage errors (``--debug``: the
traceback)::

    $ python tools/preprocess_data.py --input missing.jsonl --output-prefix /d/x
    preprocess_data.py: error: --input missing.jsonl does not exist
"""

import argparse
import os
import sys
from collections.abc import Callable


def add_common_flags(parser: argparse.ArgumentParser, overwrite: bool = True) -> None:
    """Adds ``--debug``, ``--verbose`` (and ``--overwrite``) to a tool's parser."""
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show every warning (by default those that do not apply, e.g. a missing Transformer "
        "Engine on a CPU machine, are hidden)",
    )
    if overwrite:
        parser.add_argument(
            "--overwrite",
            action="store_true",
            help="replace existing outputs (and remove stale sidecars of the output prefix)",
        )


def one_line(err: BaseException) -> str:
    """The error as one line: an OSError as 'strerror: filename', anything else its message."""
    if isinstance(err, OSError) and err.strerror:
        text = f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


def run_tool(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Runs ``main(argv)``; a ``ValueError`` / ``OSError`` becomes one stderr line and status 2."""
    args = sys.argv[1:] if argv is None else argv
    # Read off argv, not the parsed flags: the parser may be what fails.
    if "--verbose" not in args:
        from megatron_ext.common.quiet import quiet_warnings

        quiet_warnings()
    try:
        return main(argv)
    except (ValueError, OSError) as err:
        if "--debug" in args:
            raise
        # As argparse prints its own usage errors: "prog: error: ...".
        prog = os.path.basename(sys.argv[0]) if argv is None else "error"
        prefix = f"{prog}: error: " if argv is None else "error: "
        print(prefix + one_line(err), file=sys.stderr)
        return 2
