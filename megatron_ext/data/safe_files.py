"""Moved to :mod:`megatron_ext.common.safe_files` (shared by every feature); this name is the same module."""

import sys

from megatron_ext.common import safe_files as _moved

sys.modules[__name__] = _moved
