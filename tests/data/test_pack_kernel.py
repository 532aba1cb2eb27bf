"""Tests for megatron_ext.data.pack_kernel: the compiled loops give exactly the Python packs.
Tier: pure (numpy and the system C compiler, which CI has)."""

import logging
import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.data import pack_kernel
from megatron_ext.data.pack_planning import (
    MAX_KERNEL_CAPACITY,
    best_fit_order,
    best_fit_order_python,
    next_fit_offsets,
    next_fit_offsets_python,
    plan_packs,
    shuffle_packs,
    shuffle_packs_python,
)
from tests.data.test_pack_planning import naive_best_fit


@pytest.fixture
def lib():
    lib = pack_kernel.library()
    assert lib is not None, "CI has a C compiler: the pack kernel must compile there"
    return lib


def as_packs(order_Q: np.ndarray, offsets_P1: np.ndarray) -> list[list[int]]:
    return [order_Q[a:b].tolist() for a, b in zip(offsets_P1[:-1], offsets_P1[1:], strict=True)]


def test_hand_worked_best_fit(lib) -> None:
    # Module docstring: 6 opens pack 0 (room 2), 5 opens pack 1 (room 3), 3 -> pack 1, 2 -> pack 0.
    order, offsets = pack_kernel.best_fit(lib, np.array([5, 6, 3, 2]), 8, 4)
    assert order.tolist() == [1, 3, 0, 2] and offsets.tolist() == [0, 2, 4]
    # Equal rooms go to the oldest pack even when it reached that room last. Capacity 9:
    # 6 -> pack 0 (room 3); 4 -> pack 1 (room 5); 4 -> pack 1 (room 1); 2 -> pack 0 (room 1,
    # joining pack 1 there); 1 -> pack 0, the older of the two (a FIFO bucket would say pack 1).
    order, offsets = pack_kernel.best_fit(lib, np.array([6, 4, 4, 2, 1]), 9, 5)
    assert as_packs(order, offsets) == [[0, 3, 4], [1, 2]]
    assert naive_best_fit([6, 4, 4, 2, 1], 9, 5) == [[6, 2, 1], [4, 4]]  # lengths
    # A full pack leaves the buckets: 4 fills pack 0 exactly, the next 4 opens pack 1.
    order, offsets = pack_kernel.best_fit(lib, np.array([4, 4, 4]), 4, 3)
    assert as_packs(order, offsets) == [[0], [1], [2]]
    # Windows: [5 6 | 3 2] with window 2 never share a pack.
    order, offsets = pack_kernel.best_fit(lib, np.array([5, 6, 3, 2]), 8, 2)
    assert as_packs(order, offsets) == [[1], [0], [2, 3]]


def test_hand_worked_next_fit_and_empty_input(lib) -> None:
    assert pack_kernel.next_fit(lib, np.array([4, 4, 4, 8, 1]), 8).tolist() == [0, 2, 3, 4, 5]
    empty = np.zeros(0, dtype=np.int64)
    assert pack_kernel.next_fit(lib, empty, 8).tolist() == [0]
    order, offsets = pack_kernel.best_fit(lib, empty, 8, 1000)
    assert order.size == 0 and offsets.tolist() == [0]


# Capacities around the bitmap tree's level boundaries: rooms 1..cap take 1 word (cap <= 64),
# 2 levels (cap <= 4096) or 3 levels.
CAPACITIES = [1, 2, 63, 64, 65, 300, 4095, 4096, 4097, 5000]


def random_lengths(rng: np.random.Generator, cap: int, n: int, kind: int) -> np.ndarray:
    if kind == 0:
        return rng.integers(1, cap + 1, size=n)
    if kind == 1:  # few distinct values: many equal rooms, ties everywhere
        return rng.choice(np.unique(rng.integers(1, cap + 1, size=3)), size=n)
    return np.clip(rng.lognormal(np.log(cap) - 1.5, 1.0, size=n).astype(np.int64), 1, cap)


@pytest.mark.parametrize("seed", range(6))
def test_kernel_matches_the_python_loops_on_seeded_lengths(lib, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for trial in range(60):
        cap = CAPACITIES[trial % len(CAPACITIES)]
        lens = random_lengths(rng, cap, int(rng.integers(0, 700)), trial % 3)
        window = int(rng.choice([1, 2, 7, 63, 64, 65, 1000, 10**9]))
        order, offsets = pack_kernel.best_fit(lib, lens, cap, min(window, max(lens.size, 1)))
        ref_order, ref_offsets = best_fit_order_python(lens, cap, window)
        assert np.array_equal(order, ref_order) and np.array_equal(offsets, ref_offsets)
        assert np.array_equal(
            pack_kernel.next_fit(lib, lens, cap), next_fit_offsets_python(lens, cap)
        )


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 70), st.data())
def test_kernel_equals_python_loops_hypothesis(cap: int, data) -> None:
    lens = np.array(data.draw(st.lists(st.integers(1, cap), max_size=80)), dtype=np.int64)
    window = data.draw(st.integers(1, 90))
    for a, b in zip(
        best_fit_order(lens, cap, window), best_fit_order_python(lens, cap, window), strict=True
    ):
        assert np.array_equal(a, b)
    assert np.array_equal(next_fit_offsets(lens, cap), next_fit_offsets_python(lens, cap))


def test_lengths_outside_one_to_capacity_are_refused() -> None:
    for bad in ([3, 0], [9], [-1]):
        with pytest.raises(ValueError, match=r"piece lengths must lie in 1\.\.8"):
            best_fit_order(np.array(bad), 8, 4)
        with pytest.raises(ValueError, match=r"piece lengths must lie in 1\.\.8"):
            next_fit_offsets(np.array(bad), 8)


def test_compiled_once_by_concurrent_callers_then_reused(tmp_path) -> None:
    paths: list[str] = []
    threads = [
        threading.Thread(target=lambda: paths.append(pack_kernel.compile_library(str(tmp_path))))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (path,) = set(paths)  # every caller got the one complete library, no temporary file left
    assert os.listdir(tmp_path) == [pack_kernel.library_name()] == [os.path.basename(path)]
    stamp = os.stat(path).st_mtime_ns
    assert pack_kernel.compile_library(str(tmp_path)) == path and os.stat(path).st_mtime_ns == stamp
    lib = pack_kernel.load_library(path)
    assert lib.mx_tree_words(4096) == 64 + 1 and lib.mx_tree_words(4097) == 65 + 2 + 1
    order, _ = pack_kernel.best_fit(lib, np.array([5, 6, 3, 2]), 8, 4)
    assert order.tolist() == [1, 3, 0, 2]


def test_a_failing_compiler_is_reported_with_its_output(tmp_path) -> None:
    with pytest.raises(OSError, match="no C compiler"):
        pack_kernel.compile_library(str(tmp_path), compiler=str(tmp_path / "missing-cc"))
    fake = tmp_path / "bad-cc"
    fake.write_text("#!/bin/sh\necho 'bad-cc: cannot compile' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(OSError, match="cannot compile"):
        pack_kernel.compile_library(str(tmp_path / "k"), compiler=str(fake))
    assert os.listdir(tmp_path / "k") == []  # nothing half-written left behind


def test_without_a_compiler_the_python_loops_give_the_same_packs(
    lib, tmp_path, monkeypatch, caplog
) -> None:
    rng = np.random.default_rng(3)
    lens = np.clip(rng.lognormal(5.0, 1.2, size=3000).astype(np.int64), 0, 3000)
    expected = plan_packs(lens, 512, algorithm="best_fit", window=100)  # the kernel's
    expected_seq = plan_packs(lens, 512, algorithm="sequential")
    # A process whose kernel cannot compile: no compiler, an empty kernel directory.
    monkeypatch.setenv("MEGATRON_EXT_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    pack_kernel.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=pack_kernel.__name__):
            fallback = plan_packs(lens, 512, algorithm="best_fit", window=100)
            fallback_seq = plan_packs(lens, 512, algorithm="sequential")
        assert pack_kernel.library() is None  # the fallback ran, not the kernel
    finally:
        pack_kernel.library.cache_clear()  # later tests load the real kernel again
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "C kernel unavailable" in messages[0]  # warned once
    assert expected.num_split > 0  # over-long documents were split on both paths
    for got, want in ((fallback, expected), (fallback_seq, expected_seq)):
        for key in ("piece_doc_Q", "piece_start_Q", "piece_len_Q", "pack_offsets_P1"):
            assert np.array_equal(getattr(got, key), getattr(want, key))


def test_shuffle_packs_hand_worked_and_against_numpy(lib) -> None:
    # Packs [1 3] [0 2] [4]; order [2, 0, 1] -> [4] [1 3] [0 2].
    order, offsets = np.array([1, 3, 0, 2, 4]), np.array([0, 2, 4, 5])
    got, sizes = shuffle_packs(order, offsets, np.array([2, 0, 1]))
    assert got.tolist() == [4, 1, 3, 0, 2] and sizes.tolist() == [1, 2, 2]
    rng = np.random.default_rng(4)
    lens = rng.integers(1, 50, size=5000)
    order, offsets = best_fit_order(lens, 64, 300)
    order_P = rng.permutation(offsets.size - 1)
    for values in (order, order.astype(np.int32), order.astype(np.uint8)):  # any item size
        got = shuffle_packs(values, offsets, order_P)[0]
        assert got.dtype == values.dtype
        assert np.array_equal(got, shuffle_packs_python(values, offsets, order_P))
    for bad in ([0, 0, 1], [0, 1], [0, 1, 3]):  # never read or write past the arrays
        with pytest.raises(ValueError, match="order_P must be a permutation of the 3 packs"):
            shuffle_packs(np.array([1, 3, 0, 2, 4]), np.array([0, 2, 4, 5]), np.array(bad))


def test_capacities_beyond_the_bucket_table_use_the_python_loops(lib, monkeypatch) -> None:
    def refuse(*args) -> None:
        raise AssertionError("the kernel was called")

    monkeypatch.setattr(pack_kernel, "best_fit", refuse)
    monkeypatch.setattr(pack_kernel, "next_fit", refuse)
    big = MAX_KERNEL_CAPACITY + 1
    lens = np.array([5, big, 3, big - 3])
    order, offsets = best_fit_order(lens, big, 4)
    assert as_packs(order, offsets) == [[1], [3, 2], [0]]  # big-3 + 3 fills a pack exactly
    assert next_fit_offsets(lens, big).tolist() == [0, 1, 2, 4]
