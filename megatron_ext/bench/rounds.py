"""The order benchmark variants run in, round by round: balanced for what ran just before.

A Williams design (E. J. Williams, 1949): a Latin square in which every variant follows every other
one equally often. Its first row is ``0, 1, n-1, 2, n-2, ...``, row ``i`` adds ``i`` to each entry
mod ``n``; for odd ``n`` the mirrored rows are appended (``2n`` rows). For 4 variants::

    [0 1 3 2] [1 2 0 3] [2 3 1 0] [3 0 2 1]    each ordered pair adjacent exactly once
"""

# Why not rotate one order: a variant's time depends on the one before it (caches and the
# allocator's free lists hold its data). In [a b c] [b c a] [c a b] b always follows a, so b's
# paired ratio to a carries that effect in every round, and two copies of the same code can
# measure apart by their place in the order alone.

from collections.abc import Sequence


def design_length(n: int) -> int:
    """Rounds in one whole Williams design for ``n`` variants: ``n``, or ``2n`` for odd ``n``.

    A run of a multiple of this many rounds has every variant follow every other equally often.
    """
    if n < 1:
        raise ValueError(f"a design needs at least one variant, got {n}")
    return n if n % 2 == 0 else 2 * n


def williams_row(n: int, row: int) -> list[int]:
    """Row ``row`` (any int, taken modulo the design's length) of the Williams design for ``n``."""
    rows = design_length(n)
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    row %= rows
    order = [(k + row) % n for k in first]
    return order[::-1] if row >= n else order


def round_order[T](items: Sequence[T], round_index: int) -> list[T]:
    """The items in the order round ``round_index`` runs them (see the module docstring)."""
    # A function of the round alone: ranks that must pair their collectives (EP benchmarks) run
    # the same order.
    return [items[k] for k in williams_row(len(items), round_index)]
