"""Moved to :mod:`megatron_ext.common.temp_names` (shared by every feature); this name is the same module."""

import sys

from megatron_ext.common import temp_names as _moved

sys.modules[__name__] = _moved
