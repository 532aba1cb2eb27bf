"""Tests for megatron_ext.data.pack_planning. Tier: pure (numpy only)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.data.pack_planning import (
    best_fit_order,
    cut_overlong,
    next_fit_offsets,
    plan_packs,
)


def packs_of(plan) -> list[list[int]]:
    """Piece lengths per pack, for hand-worked comparisons."""
    o = plan.pack_offsets_P1
    return [plan.piece_len_Q[o[p] : o[p + 1]].tolist() for p in range(plan.num_packs)]


def test_hand_worked_docstring_example() -> None:
    lens = np.array([5, 6, 3, 2])
    assert packs_of(plan_packs(lens, 8, algorithm="sequential")) == [[5], [6], [3, 2]]
    best = plan_packs(lens, 8, algorithm="best_fit", window=4)
    # Decreasing: 6 opens A(room 2), 5 opens B(room 3), 3 -> B (room 3 fits exactly), 2 -> A.
    assert packs_of(best) == [[6, 2], [5, 3]]
    assert best.piece_doc_Q.tolist() == [1, 3, 0, 2]
    assert best.pack_lengths_P().tolist() == [8, 8]


def test_best_fit_window_bounds_movement() -> None:
    lens = np.array([5, 6, 3, 2])
    # window 2: [5 6] and [3 2] are packed separately, no pack spans windows.
    assert packs_of(plan_packs(lens, 8, algorithm="best_fit", window=2)) == [
        [6],
        [5],
        [3, 2],
    ]


def test_overlong_policies_hand_worked() -> None:
    lens = np.array([3, 10, 0, 4])
    doc, start, ln, counts = cut_overlong(lens, 4, "split")
    assert doc.tolist() == [0, 1, 1, 1, 3]
    assert start.tolist() == [0, 0, 4, 8, 0] and ln.tolist() == [3, 4, 4, 2, 4]
    assert counts == {
        "num_split": 1,
        "num_truncated": 0,
        "num_dropped": 0,
        "num_empty": 1,
    }
    doc, start, ln, counts = cut_overlong(lens, 4, "truncate")
    assert doc.tolist() == [0, 1, 3] and ln.tolist() == [3, 4, 4] and start.tolist() == [0, 0, 0]
    assert counts["num_truncated"] == 1
    doc, _, ln, counts = cut_overlong(lens, 4, "drop")
    assert doc.tolist() == [0, 3] and counts["num_dropped"] == 1 and counts["num_empty"] == 1


def test_empty_and_single_inputs() -> None:
    for algorithm in ("sequential", "best_fit"):
        empty = plan_packs(np.zeros(0, dtype=np.int64), 8, algorithm=algorithm)
        assert empty.num_packs == 0 and empty.pack_offsets_P1.tolist() == [0]
        one = plan_packs(np.array([8]), 8, algorithm=algorithm)
        assert packs_of(one) == [[8]]


def naive_next_fit(lens: list[int], cap: int) -> list[list[int]]:
    packs, cur = [], []
    for x in lens:
        if cur and sum(cur) + x > cap:
            packs.append(cur)
            cur = []
        cur.append(x)
    return packs + ([cur] if cur else [])


def naive_best_fit(lens: list[int], cap: int, window: int) -> list[list[int]]:
    out = []
    for w0 in range(0, len(lens), window):
        chunk = sorted(enumerate(lens[w0 : w0 + window]), key=lambda t: (-t[1], t[0]))
        bins: list[list[int]] = []
        for _, x in chunk:
            fits = [(cap - sum(b) - x, i) for i, b in enumerate(bins) if sum(b) + x <= cap]
            if fits:
                bins[min(fits)[1]].append(x)
            else:
                bins.append([x])
        out.extend(bins)
    return out


@pytest.mark.parametrize("seed", range(10))
def test_matches_naive_references(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cap = int(rng.integers(4, 40))
    lens = rng.integers(1, cap + 1, size=int(rng.integers(0, 60)))
    window = int(rng.integers(1, 30))
    assert packs_of(plan_packs(lens, cap, algorithm="sequential")) == naive_next_fit(
        lens.tolist(), cap
    )
    assert packs_of(plan_packs(lens, cap, algorithm="best_fit", window=window)) == naive_best_fit(
        lens.tolist(), cap, window
    )


def test_best_fit_beats_sequential_on_skewed_lengths() -> None:
    rng = np.random.default_rng(0)
    lens = np.clip(rng.lognormal(5.0, 1.0, size=2000).astype(np.int64), 1, 2048)
    seq = plan_packs(lens, 2048, algorithm="sequential")
    best = plan_packs(lens, 2048, algorithm="best_fit", window=500)
    assert best.num_packs < seq.num_packs
    assert seq.pack_lengths_P().sum() == best.pack_lengths_P().sum() == lens.sum()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 50), max_size=40),
    st.integers(1, 20),
    st.sampled_from(["sequential", "best_fit"]),
    st.sampled_from(["split", "truncate", "drop"]),
    st.integers(1, 12),
)
def test_plan_invariants(lens, cap, algorithm, overlong, window) -> None:
    lens = np.array(lens, dtype=np.int64)
    plan = plan_packs(lens, cap, algorithm=algorithm, window=window, overlong=overlong)
    pack_lens = plan.pack_lengths_P()
    assert (pack_lens >= 1).all() and (pack_lens <= cap).all()
    assert (plan.piece_len_Q >= 1).all()
    assert plan.pack_offsets_P1[0] == 0 and plan.pack_offsets_P1[-1] == plan.piece_len_Q.size
    assert (plan.piece_start_Q + plan.piece_len_Q <= lens[plan.piece_doc_Q]).all()
    # Token accounting per policy; every kept document appears (split: all of it).
    long_ = lens > cap
    kept = {
        "split": lens.sum(),
        "truncate": np.minimum(lens, cap).sum(),
        "drop": lens[~long_].sum(),
    }[overlong]
    assert pack_lens.sum() == kept
    assert plan.num_split + plan.num_truncated + plan.num_dropped == long_.sum()
    assert plan.num_empty == (lens == 0).sum()
    if overlong == "split":  # pieces of one document tile it exactly once
        for d in np.flatnonzero(lens):
            sel = plan.piece_doc_Q == d
            starts = np.sort(plan.piece_start_Q[sel])
            assert starts.tolist() == list(range(0, lens[d], cap))


def naive_cut(lens: list[int], cap: int, policy: str) -> list[tuple[int, int, int]]:
    """(document, start, length) of every piece, document by document."""
    pieces = []
    for d, n in enumerate(lens):
        if n == 0 or (n > cap and policy == "drop"):
            continue
        ends = range(0, n, cap) if policy == "split" else [0]
        pieces += [(d, s, min(cap, n - s)) for s in ends]
    return pieces


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 50), max_size=40),
    st.integers(1, 20),
    st.sampled_from(["split", "truncate", "drop"]),
)
def test_cut_overlong_matches_a_loop(lens, cap, policy) -> None:
    doc, start, ln, counts = cut_overlong(np.array(lens, dtype=np.int64), cap, policy)
    assert list(zip(doc.tolist(), start.tolist(), ln.tolist(), strict=True)) == naive_cut(
        lens, cap, policy
    )
    assert doc.dtype == start.dtype == ln.dtype == np.int64
    assert counts["num_split"] == (sum(n > cap for n in lens) if policy == "split" else 0)


def test_next_fit_and_best_fit_primitives() -> None:
    assert next_fit_offsets(np.array([4, 4, 4]), 8).tolist() == [0, 2, 3]
    order, offsets = best_fit_order(np.array([1, 7, 2, 6]), 8, 4)
    assert order.tolist() == [1, 0, 3, 2] and offsets.tolist() == [0, 2, 4]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"capacity": 0}, "--seq-length must be >= 1"),
        ({"algorithm": "first_fit"}, "unknown --packing-algorithm 'first_fit'"),
        ({"overlong": "wrap"}, "unknown --pack-overlong-policy 'wrap'"),
        ({"window": 0, "algorithm": "best_fit"}, "--packing-window must be >= 1"),
        ({"doc_lens_D": np.array([1, -2])}, "document lengths must be >= 0"),
    ],
)
def test_bad_inputs(kwargs: dict, match: str) -> None:
    args = {"doc_lens_D": np.array([3, 4]), "capacity": 8}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_packs(**args)


def test_context_parallel_plans_count_each_document_padded_to_2cp() -> None:
    # Capacity 8, CP 2 (multiple 4): [3, 3, 2] pack as [3 3 2] without CP, but each takes a slot
    # of 4 with it, so only two fit a pack.
    lens = np.array([3, 3, 2])
    assert plan_packs(lens, 8, algorithm="sequential").num_packs == 1
    plan = plan_packs(lens, 8, algorithm="sequential", doc_multiple=4)
    assert plan.num_packs == 2 and plan.pack_lengths_P().tolist() == [6, 2]
    with pytest.raises(ValueError, match="not a multiple of the per-document pad multiple 4"):
        plan_packs(lens, 10, doc_multiple=4)
