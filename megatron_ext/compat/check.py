"""The startup check: refuse a megatron-core version or a Megatron source the table was not checked on.

Every row of :data:`megatron_ext.compat.table.TABLE` carries the fingerprint of the Megatron source it
replaces (or copies). A launch hashes those sources once (a few dozen functions, milliseconds) and
refuses, in one line, an installed megatron-core outside the tested versions or a changed source,
naming both; ``--allow-untested-megatron`` runs anyway.

Example::

    problem = check_megatron()
    # None, or "megatron-core 0.20.0 is untested (tested: 0.19.2); changed since tested:
    #  megatron.core.transformer.moe.router.Router.gating"
"""

import importlib.metadata
from collections.abc import Iterable

from megatron_ext.compat.patch import TESTED_MEGATRON, Patch, fingerprint, original
from megatron_ext.compat.table import TABLE


def installed_megatron() -> str:
    """The installed megatron-core's version."""
    return importlib.metadata.version("megatron-core")


def found_fingerprint(row: Patch) -> str:
    """The fingerprint of the installed Megatron source of ``row`` (``gone (why)`` if it is not there)."""
    try:
        return fingerprint(original(row))
    except (RuntimeError, AttributeError, ImportError, OSError, TypeError) as err:
        return f"gone ({err})"


def changed_rows(table: Iterable[Patch] = TABLE) -> list[str]:
    """``module.attribute`` of each row whose Megatron source no longer has its fingerprint (or is gone)."""
    changed = []
    for row in table:
        if found_fingerprint(row) != row.fingerprint:
            changed.append(row.name)
    return list(dict.fromkeys(changed))


def check_megatron(version: str | None = None, table: Iterable[Patch] = TABLE) -> str | None:
    """One line naming what is untested (the version found vs tested, the changed sources), or None."""
    version = installed_megatron() if version is None else version
    problems = []
    if version not in TESTED_MEGATRON:
        problems.append(
            f"megatron-core {version} is untested (tested: {', '.join(TESTED_MEGATRON)})"
        )
    changed = changed_rows(table)
    if changed:
        problems.append(
            f"Megatron source changed since tested (megatron-core {version}): {', '.join(changed)}"
        )
    if not problems:
        return None
    return (
        "megatron_ext: " + "; ".join(problems) + ". megatron_ext patches or copies these "
        "(docs/compat.md); --allow-untested-megatron runs anyway"
    )


def main() -> int:
    """``python -m megatron_ext.compat.check``: each row whose Megatron source changed, with the
    fingerprint it was checked with and the one found (for a new megatron-core version)."""
    version = installed_megatron()
    print(f"megatron-core {version} (tested: {', '.join(TESTED_MEGATRON)}); {len(TABLE)} rows")
    changed = 0
    for row in TABLE:
        found = found_fingerprint(row)
        if found != row.fingerprint:
            changed += 1
            print(f"changed  {row.group:28s} {row.name}: checked {row.fingerprint}, found {found}")
    print(f"{changed} row(s) changed" if changed else "every row's source is as tested")
    return 1 if changed or version not in TESTED_MEGATRON else 0


if __name__ == "__main__":
    raise SystemExit(main())
