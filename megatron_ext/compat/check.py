"""The startup check: refuse a megatron-core version or a Megatron source the table was not checked on
(``--allow-untested-megatron`` runs anyway); ``python -m megatron_ext.compat.check`` on a new
version (docs/compat.md). Example::

    problem = check_megatron(groups=launch_groups(cpu=False, dry_run=False))
    # None, or "megatron-core 0.20.0 is untested (tested: 0.18.2, 0.19.2); changed since tested:
    #  megatron.core.transformer.moe.router.Router.gating"
"""

import argparse
import collections
import importlib.util
from collections.abc import Iterable

from megatron_ext.compat.patch import Needs, Patch, original, row_fingerprint
from megatron_ext.compat.table import TABLE
from megatron_ext.compat.versions import TESTED_MEGATRON, installed_megatron, table_version

#: Rows every launch may apply, GPU included: the launch's own, those applied by an object the
#: run creates (route replay, the resume checks) and Megatron bodies copied into megatron_ext.
EVERY_LAUNCH = ("launch", "owned", "copied")


def launch_groups(
    cpu: bool, dry_run: bool, cuda: bool | None = None, te: bool | None = None
) -> tuple[str, ...]:
    """The table's groups a ``pretrain_gpt`` launch applies.

    Args:
        cpu: A ``--cpu`` launch.
        dry_run: A ``--dry-run``.
        cuda: Whether there is a CUDA device (default: asked here).
        te: Whether Transformer Engine is installed (default: asked here).
    """
    # Only the rows a launch applies are checked: a GPU launch never applies the CPU rows, so a
    # changed CPU-only source does not stop it.
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if te is None:
        te = importlib.util.find_spec("transformer_engine") is not None
    groups = list(EVERY_LAUNCH)
    if cpu:
        groups += ["cpu", "cpu_loop", "fp4_rehearsal"]
    # Validation asks the device's capability: without one, the target's (an H100/H200).
    if (cpu or dry_run) and not cuda:
        groups.append("validate_on_target")
    # And Transformer Engine's version, which a dry run on a login node may not have.
    if dry_run and not cpu and not te:
        groups.append("dry_run_target")
    return tuple(groups)


def _in_groups(row: Patch, groups: Iterable[str] | None) -> bool:
    return groups is None or row.group in groups or row.group.split(".")[0] in groups


def found_fingerprint(row: Patch) -> str:
    """The fingerprint of the installed Megatron source of ``row`` over the span that matters to
    it (``gone (why)`` if it is not there); for a row checked by what it needs, that need when
    met, else the kind found."""
    try:
        value = original(row)
    except (RuntimeError, AttributeError, ImportError, OSError, TypeError) as err:
        return f"gone ({err})"
    # A value that is not Megatron-defined code (an optional TE kernel) is checked by kind.
    if isinstance(row.fingerprint, Needs):
        return str(row.fingerprint) if row.fingerprint.met_by(value) else type(value).__qualname__
    try:
        return row_fingerprint(row, value)
    except (OSError, TypeError, RuntimeError) as err:
        return f"gone ({err})"


def _expected(row: Patch, version: str) -> str:
    return str(row.fingerprint_on(version))


def changed_rows(
    table: Iterable[Patch] = TABLE,
    groups: Iterable[str] | None = None,
    version: str | None = None,
) -> list[str]:
    """``module.attribute`` of each row (of ``groups``; None: all) applying on ``version``
    (default: the running Megatron's) whose source or value no longer matches, or that is gone."""
    groups = None if groups is None else tuple(groups)
    version = table_version(installed_megatron() if version is None else version)
    changed = []
    for row in table:
        if not (_in_groups(row, groups) and row.applies_on(version)):
            continue
        if found_fingerprint(row) != _expected(row, version):
            changed.append(row.name)
    return list(dict.fromkeys(changed))


def check_megatron(
    version: str | None = None,
    table: Iterable[Patch] = TABLE,
    groups: Iterable[str] | None = None,
) -> str | None:
    """One line naming what is untested (the version found vs tested, the changed sources of the
    rows of ``groups``, every row when None), or None."""
    # An untested version's rows are checked against the nearest tested version's fingerprints.
    version = installed_megatron() if version is None else version
    problems = []
    if version not in TESTED_MEGATRON:
        problems.append(
            f"megatron-core {version} is untested (tested: {', '.join(TESTED_MEGATRON)})"
        )
    changed = changed_rows(table, groups, version)
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


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_ext.compat.check``: each row whose Megatron source changed, with the
    fingerprint checked and found and its triage; ``--fingerprints`` lists every row's found one
    (to put in the table once a version is checked)."""
    from megatron_ext.compat.triage import triage

    parser = argparse.ArgumentParser(prog="python -m megatron_ext.compat.check")
    parser.add_argument("--fingerprints", action="store_true",
                        help="print every row's fingerprint on the installed Megatron")  # fmt: skip
    if parser.parse_args(argv).fingerprints:
        for row in TABLE:
            print(f"{row.group:28s} {row.name}: {found_fingerprint(row)}")
        return 0
    version = installed_megatron()
    rows_of = table_version(version)
    applying = [row for row in TABLE if row.applies_on(rows_of)]
    print(f"megatron-core {version} (tested: {', '.join(TESTED_MEGATRON)}); {len(applying)} of "
          f"{len(TABLE)} rows apply" + ("" if rows_of == version else f" (those of {rows_of})"))  # fmt: skip
    verdicts: collections.Counter[str] = collections.Counter()
    for row in applying:
        found, expected = found_fingerprint(row), _expected(row, rows_of)
        if found != expected:
            found = "gone" if found.startswith("gone") else found  # the triage says where
            verdict = triage(row, applying)
            verdicts[verdict.verdict] += 1
            print(f"changed  {row.group:28s} {row.name}: checked {expected}, found {found}")
            print(f"         {verdict}")
    changed = sum(verdicts.values())
    if changed:
        print(f"{changed} row(s) changed: "
              + ", ".join(f"{n} {verdict}" for verdict, n in verdicts.most_common()))  # fmt: skip
    else:
        print("every row's source is as tested")
    return 1 if changed or version not in TESTED_MEGATRON else 0


if __name__ == "__main__":
    raise SystemExit(main())
