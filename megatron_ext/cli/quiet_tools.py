"""Imported first by megatron_ext's command-line tools: hides warnings that do not apply, unless --verbose.

Only the messages listed in :mod:`megatron_ext.common.quiet` are hidden; with ``--verbose`` nothing is.
"""

import sys

from megatron_ext.common.quiet import quiet_warnings

# At import, not in a function: Megatron warns at its own import time (missing Transformer Engine /
# Apex, no CUDA runtime), before a tool's ``main`` runs, so the filters must already be in place.
if "--verbose" not in sys.argv[1:]:
    quiet_warnings()
