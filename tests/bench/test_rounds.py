"""Tier: pure (the order benchmark variants run in, round by round)."""

import collections
import itertools

import pytest

from megatron_ext.bench.rounds import design_length, round_order, williams_row


def test_hand_worked_four_variants():
    # First row 0, 1, n-1, 2; row i adds i mod 4 (the module docstring's square).
    rows = [williams_row(4, r) for r in range(4)]
    assert rows == [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]
    assert williams_row(4, 4) == rows[0] and williams_row(4, -1) == rows[3]


@pytest.mark.parametrize("n", range(1, 10))
def test_every_variant_follows_every_other_equally_often(n):
    """Over one full design every row is a permutation and each ordered pair of distinct
    variants is adjacent equally often (once for even n, twice for odd n over 2n rows): what
    ``design_length`` promises a benchmark that runs a multiple of it."""
    length = design_length(n)
    follows = collections.Counter()
    for r in range(length):
        row = williams_row(n, r)
        assert sorted(row) == list(range(n))
        follows.update(itertools.pairwise(row))
    pairs = list(itertools.permutations(range(n), 2))
    assert set(follows) == set(pairs)
    assert len(set(follows.values())) <= 1  # balanced
    if n > 2:  # the case rotation gets wrong: a variant's predecessor never changes
        rotated = [list(range(r, n)) + list(range(r)) for r in range(n)]
        assert _predecessors(rotated, 1) == {0}
        assert len(_predecessors([williams_row(n, r) for r in range(length)], 1)) == n - 1


def _predecessors(rows: list[list[int]], item: int) -> set[int]:
    """What ran just before ``item`` within a round, over the rows."""
    return {row[row.index(item) - 1] for row in rows if row.index(item) > 0}


def test_round_order_is_the_same_on_every_call_and_refuses_nothing_to_order():
    names = ["unaligned", "fp8", "mxfp8", "nvfp4", "floor"]
    assert round_order(names, 7) == round_order(list(names), 7)  # ranks agree
    assert sorted(round_order(names, 7)) == sorted(names)
    with pytest.raises(ValueError, match="at least one variant"):
        round_order([], 0)
