"""Imported first by megatron_ext's command-line tools: hides warnings that do not apply, unless --verbose.

Megatron warns at import time (missing Transformer Engine / Apex, no CUDA runtime), before a tool's
``main`` runs, so the filters must be in place before the tool imports anything that imports Megatron.
Only the messages listed in :mod:`megatron_ext.common.quiet` are hidden; with ``--verbose`` nothing is.
"""

import sys

from megatron_ext.common.quiet import quiet_warnings

if "--verbose" not in sys.argv[1:]:
    quiet_warnings()
