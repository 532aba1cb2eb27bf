"""Tier: pure (docs/compat.md and the table read; Megatron not imported).

docs/compat.md's table of groups and its row counts are the table's: every group named there
exists, each group of the table is in exactly one line of the doc's table, and each count (rows per
line, groups per ``cpu.*`` family, rows in all, modules, rows per kind of replacement, rows per
supported version) is derived from :data:`~megatron_ext.compat.table.TABLE` here; its table of
rows per version names exactly the rows that differ between versions, as they differ.
"""

import re
from pathlib import Path

from megatron_ext.compat.host_torch import HostTorch
from megatron_ext.compat.table import TABLE
from megatron_ext.compat.versions import TESTED_MEGATRON

DOC = (Path(__file__).resolve().parents[2] / "docs" / "compat.md").read_text()
GROUPS = {row.group for row in TABLE}


def _doc_table() -> list[tuple[list[str], int | None, int]]:
    """Each line of the doc's group table: the groups named (``cpu.*`` a family), the number of
    groups it says the family has, and its row count."""
    found = []
    for line in DOC.splitlines():
        match = re.match(r"\| (`[^|]+) \| (\d+) \|", line)
        if match:
            names = re.findall(r"`([a-z0-9_.*]+)`", match.group(1))
            groups = re.search(r"\((\d+) groups\)", match.group(1))
            found.append((names, int(groups.group(1)) if groups else None, int(match.group(2))))
    return found


def _rows_of(name: str) -> list[str]:
    family = name.removesuffix(".*")
    if name.endswith(".*"):
        return [row.group for row in TABLE if row.group.startswith(family + ".")]
    return [row.group for row in TABLE if row.group == name]


def test_the_docs_group_table_counts_the_tables_rows() -> None:
    lines = _doc_table()
    assert len(lines) >= 5, "the doc's group table was not found"
    covered = []
    for names, group_count, rows in lines:
        matched = [group for name in names for group in _rows_of(name)]
        assert all(_rows_of(name) for name in names), f"a group of {names} has no rows"
        assert len(matched) == rows, (names, len(matched), rows)
        if group_count is not None:
            assert len(set(matched)) == group_count, (names, sorted(set(matched)))
        covered += sorted(set(matched))
    assert sorted(covered) == sorted(GROUPS), "each group in exactly one line of the doc's table"


def test_every_group_the_doc_names_exists() -> None:
    named = set(re.findall(r"`(cpu(?:_loop)?\.[a-z_]+)`", DOC))
    assert named and named <= GROUPS, named - GROUPS


def test_the_docs_counts_are_the_tables() -> None:
    host = sum(isinstance(row.replacement, HostTorch) for row in TABLE)
    factories = sum(isinstance(row.replacement, str) for row in TABLE)
    counts = {
        r"(\d+) rows over (\d+) Megatron modules": (len(TABLE), len({r.module for r in TABLE})),
        r"(\d+) rows are per-function CPU stand-ins": (host,),
        r"The other (\d+) rows\s+replace one attribute": (factories,),
        r"the last (\d+) \(`owned`, `copied`\)": (len(TABLE) - host - factories,),
        r"a row with `depends_on` \((\d+) rows": (sum(bool(row.depends_on) for row in TABLE),),
    }
    for pattern, expected in counts.items():
        match = re.search(pattern, DOC)
        assert match, pattern
        assert tuple(int(n) for n in match.groups()) == expected, (pattern, expected)
    assert {row.group for row in TABLE if row.replacement is None} == {"owned", "copied"}


def test_the_docs_rows_per_version_are_the_tables() -> None:
    counts = re.search(r"(\d+) rows apply on ([\d.]+) and (\d+) on ([\d.]+)", DOC)
    assert counts, "the rows-per-version counts were not found"
    found = {counts.group(2): int(counts.group(1)), counts.group(4): int(counts.group(3))}
    assert found == {v: sum(r.applies_on(v) for r in TABLE) for v in TESTED_MEGATRON}
    section = DOC.split("## Supported versions: rows per version")[1].split("\n## ")[0]
    header = re.search(r"^\| row \| (.+) \| why \|$", section, re.M)
    assert header, "the rows-per-version table was not found"
    versions = header.group(1).split(" | ")
    assert versions == list(TESTED_MEGATRON)
    listed = {}
    for line in section.splitlines():
        match = re.match(r"\| `([\w.]+)`[^|]* \| ([^|]+) \| ([^|]+) \|", line)
        if match:
            listed[match.group(1)] = dict(
                zip(versions, (match.group(2), match.group(3)), strict=True)
            )
    differing = [r for r in TABLE
                 if set(r.versions) != set(TESTED_MEGATRON) or isinstance(r.fingerprint, dict)]  # fmt: skip
    assert len(listed) == len(differing) >= 10, (sorted(listed), [r.name for r in differing])
    for row in differing:
        names = [n for n in listed if row.name.endswith("." + n)]
        assert len(names) == 1, (row.name, names)
        for version, said in listed[names[0]].items():
            expected = (
                "not there" if not row.applies_on(version)
                else "own fingerprint" if isinstance(row.fingerprint, dict)
                else "applies"
            )  # fmt: skip
            assert said == expected, (row.name, version, said)
