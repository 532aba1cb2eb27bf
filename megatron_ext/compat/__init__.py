"""megatron_ext's compatibility layer: every change to Megatron-Core's behaviour in one table
(docs/compat.md), applied by group for a block or for the process. Example::

    from megatron_ext import compat
    with compat.patched("cpu"):       # Megatron's model stack on CPU, undone on exit
        ...
"""

import contextlib
from collections.abc import Iterator

from megatron_ext.compat.patch import Patch, applied, patched_rows, restore
from megatron_ext.compat.patch import apply as apply_rows
from megatron_ext.compat.table import TABLE, row, rows

__all__ = ["TABLE", "Patch", "applied", "apply", "apply_rows", "patched", "restore", "row", "rows"]


def apply(*groups: str) -> list[Patch]:
    """Applies the rows of ``groups`` for the rest of the process (idempotent); returns those applied."""
    return apply_rows(rows(*groups))


@contextlib.contextmanager
def patched(*groups: str) -> Iterator[list[Patch]]:
    """Within the block the rows of ``groups`` are applied; the ones it applied are undone on exit."""
    with patched_rows(rows(*groups)) as done:
        yield done
