"""Tests for megatron_ext.compat.versions. Tier: pure (version strings; Megatron not imported).

Which tested version's rows a megatron-core version takes: its own when tested, else the newest
tested one at or below it, else the oldest (an untested version runs only with
``--allow-untested-megatron``).
"""

import pytest

from megatron_ext.compat.versions import TESTED_MEGATRON, table_version


def test_the_tested_versions_are_ordered_oldest_first() -> None:
    assert TESTED_MEGATRON == ("0.18.2", "0.19.2")


@pytest.mark.parametrize(
    ("version", "rows_of"),
    [
        ("0.18.2", "0.18.2"),
        ("0.19.2", "0.19.2"),
        ("0.18.3", "0.18.2"),  # after 0.18.2, before 0.19.2
        ("0.19.1", "0.18.2"),
        ("0.19.3", "0.19.2"),
        ("0.20.0rc1", "0.19.2"),  # a pre-release counts as its release
        ("0.17.1", "0.18.2"),  # below every tested version: the oldest
        ("1.0.0", "0.19.2"),
    ],
)
def test_an_untested_version_takes_the_nearest_tested_rows_at_or_below_it(version, rows_of) -> None:
    assert table_version(version) == rows_of
