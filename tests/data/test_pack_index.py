"""Tests for megatron_ext.data.pack_index (the compact index) and its use by PackedDataset.
Tier: pure (the slot codec) and Megatron on one rank (PackedDataset through Megatron's builder)."""

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.data import pack_index_cache, pack_kernel
from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.data.pack_index import (
    PACK_INDEX_FORMAT,
    PackIndex,
    PieceSlots,
    smallest_index_dtype,
)
from megatron_ext.data.pack_planning import best_fit_order_python, cut_overlong
from megatron_ext.data.packed_dataset import PackedDataset, PackedDatasetConfig
from tests.data.dataset_helpers import build_splits, gpt_config_kwargs
from tests.import_probe import imported_from


def test_hand_worked_docstring_example() -> None:
    lens = np.array([3, 10, 0, 4])
    slots = PieceSlots.of(lens, 4, split=True)
    # Slots d0: 0 | d1: 1, 4 5 | d2: 2 | d3: 3 (document 1's later pieces after the 4 documents).
    assert slots.num_slots == 6
    assert slots.multi_doc_M.tolist() == [1] and slots.later_M1.tolist() == [0, 2]
    doc, start, ln, _ = cut_overlong(lens, 4, "split")
    piece = slots.encode(doc, start)
    assert piece.tolist() == [0, 1, 4, 5, 3] and piece.dtype == np.int32
    asked = np.array([5, 3, 2])
    assert [a.tolist() for a in slots.decode(asked)] == [[1, 3, 2], [8, 0, 0], [2, 4, 0]]
    assert asked.tolist() == [5, 3, 2]  # decode leaves its input alone
    # Without split every document owns one slot, its number.
    truncated = PieceSlots.of(lens, 4, split=False)
    assert truncated.num_slots == 4
    assert [a.tolist() for a in truncated.decode(np.array([1, 3]))] == [[1, 3], [0, 0], [4, 4]]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 60), max_size=50),
    st.integers(1, 16),
    st.sampled_from(["split", "truncate", "drop"]),
)
def test_encode_decode_round_trip(lens, cap, policy) -> None:
    lens = np.array(lens, dtype=np.int64)
    slots = PieceSlots.of(lens, cap, split=policy == "split")
    doc, start, ln, _ = cut_overlong(lens, cap, policy)
    rng = np.random.default_rng(len(lens))
    perm = rng.permutation(doc.size)  # any order, as packs hold pieces
    piece = slots.encode(doc[perm], start[perm])
    assert np.unique(piece).size == piece.size  # one slot per piece
    assert piece.size == 0 or 0 <= piece.min() <= piece.max() < slots.num_slots
    for got, want in zip(slots.decode(piece), (doc[perm], start[perm], ln[perm]), strict=True):
        assert np.array_equal(got, want)


def test_index_dtypes_widen_only_when_needed() -> None:
    assert smallest_index_dtype(2**31 - 1) is np.int32 and smallest_index_dtype(2**31) is np.int64
    # Slots beyond int32: 3 documents of 2**30 tokens cut at capacity 1.
    slots = PieceSlots.of(np.full(3, 2**30, dtype=np.int64), 1, split=True)
    assert slots.num_slots == 3 * 2**30
    piece = slots.encode(np.array([2]), np.array([2**30 - 1]))
    assert piece.dtype == np.int64 and piece.tolist() == [3 * 2**30 - 1]
    assert [a.tolist() for a in slots.decode(piece)] == [[2], [2**30 - 1], [1]]


def test_problems_of_a_bad_index_are_named() -> None:
    slots = PieceSlots.of(np.array([3, 10, 0, 4]), 4, split=True)
    good = PackIndex(np.array([0, 1, 4, 5, 3], np.int32), np.array([0, 2, 5], np.int32), slots)
    assert good.problem() is None and good.num_packs == 2
    assert [a.tolist() for a in good.pack_pieces(1)] == [[1, 1, 3], [4, 8, 0], [4, 2, 4]]
    assert list(good) == ["piece_doc_Q", "piece_start_Q", "piece_len_Q", "pack_offsets_P1"]
    assert good["piece_len_Q"].tolist() == [3, 4, 4, 2, 4]
    with pytest.raises(KeyError):
        good["counts"]
    cases = {
        "pack offsets do not cover the pieces": ([0, 1, 2], [0, 2, 4]),
        "a pack without pieces": ([0, 1, 2], [0, 0, 3]),
        "a piece slot outside 0..5": ([0, 6, 2], [0, 1, 3]),
    }
    for message, (piece, offsets) in cases.items():
        assert PackIndex(np.array(piece), np.array(offsets), slots).problem() == message


# ---- PackedDataset on the compact index -------------------------------------------------

SEQ = 32


def old_build_plan(lens_all: np.ndarray, indices: np.ndarray, seed: int, window: int):
    """PackedDataset._build_plan before the compact index (one epoch, best_fit, split), with the
    Python loops: the packs as lists of (document, start, length) in sample order."""
    rng = np.random.default_rng((seed, 0))
    docs = rng.permutation(indices.astype(np.int64))
    doc, start, ln, _ = cut_overlong(lens_all[docs], SEQ, "split")
    order, offsets = best_fit_order_python(ln, SEQ, window)
    doc, start, ln = doc[order], start[order], ln[order]
    packs = [
        list(zip(docs[doc[a:b]].tolist(), start[a:b].tolist(), ln[a:b].tolist(), strict=True))
        for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    ]
    return [packs[p] for p in rng.permutation(len(packs))]


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory) -> tuple[str, list]:
    rng = np.random.default_rng(5)
    lens = np.concatenate([rng.integers(1, SEQ, size=300), rng.integers(SEQ + 1, 4 * SEQ, 40)])
    docs = [rng.integers(1, 100, size=int(n)) for n in rng.permutation(lens)]
    prefix = str(tmp_path_factory.mktemp("compact") / "docs")
    write_documents(prefix, docs)
    return prefix, docs


def build(prefix: str, cache: str | None, seq: int = SEQ, **kw) -> PackedDataset:
    cfg = PackedDatasetConfig(
        **gpt_config_kwargs([prefix], sequence_length=seq, path_to_cache=cache, random_seed=3),
        pad_to_seq_len=True,
        **kw,
    )
    return build_splits(PackedDataset, cfg, [None, 0, 0])[0]


def test_same_packs_as_before_the_compact_index(long_corpus, tmp_path) -> None:
    prefix, docs = long_corpus
    assert pack_kernel.library() is not None  # the dataset below is planned by the kernel
    ds = build(prefix, str(tmp_path), packing_window=50)
    lens_all = np.array([d.size for d in docs])
    expected = old_build_plan(lens_all, ds.indices, seed=3, window=50)
    got = [list(zip(*(a.tolist() for a in ds.pack_pieces(p)), strict=True)) for p in range(len(ds))]
    assert got == expected
    assert ds.stats["num_split"] == 40  # the over-long documents were split
    for p in range(0, len(ds), 7):  # and each sample reads exactly those pieces
        real = np.concatenate([docs[d][s : s + n] for d, s, n in got[p]])
        assert np.array_equal(ds[p]["tokens"].numpy()[: real.size], real)


def test_index_costs_at_most_8_bytes_per_document(tmp_path) -> None:
    # 20k documents of SFT-like lengths; the .bin is sparse (only lengths matter to the index).
    from megatron_ext.bench.packing import sft_like_lengths, write_lengths_only

    prefix = str(tmp_path / "docs")
    lens = sft_like_lengths(20_000)
    write_lengths_only(prefix, lens)
    ds = build(prefix, str(tmp_path / "cache"), seq=4096)  # the benchmark's setting
    (name,) = os.listdir(tmp_path / "cache")
    size = os.path.getsize(tmp_path / "cache" / name)
    assert size / lens.size <= 8  # was 26 (three int64 per piece plus int64 offsets)
    arrays = pack_index_cache.load(str(tmp_path / "cache" / name))
    assert set(arrays) == {"piece_Q", "pack_offsets_P1", "counts"}
    assert arrays["piece_Q"].dtype == arrays["pack_offsets_P1"].dtype == np.int32
    assert ds.stats["num_split"] > 0 and int(ds.plan["piece_len_Q"].sum()) == lens.sum()


def test_the_index_format_is_part_of_the_cache_key(long_corpus, tmp_path) -> None:
    prefix, _ = long_corpus
    ds = build(prefix, str(tmp_path))
    assert ds.unique_identifiers["pack_index_format"] == PACK_INDEX_FORMAT
    assert json.loads(ds.unique_description)["pack_index_format"] == PACK_INDEX_FORMAT
    # A file of another layout under this key (hand-made: old caches have other names) is
    # refused by name, never decoded.
    path = ds._cache_path()
    old_layout = {k: ds.plan[k] for k in ds.plan}
    pack_index_cache.save_atomically(path, old_layout, ds.unique_description)
    with pytest.raises(ValueError, match=r"lacks \['piece_Q', 'counts'\]; delete it"):
        build(prefix, str(tmp_path))


def test_a_slot_of_an_empty_document_is_refused_when_read(tmp_path) -> None:
    prefix = str(tmp_path / "e")
    write_documents(prefix, [np.ones(5, np.int32), np.zeros(0, np.int32), np.ones(3, np.int32)])
    ds = build(prefix, str(tmp_path / "c"))
    assert sorted(ds.plan["piece_doc_Q"].tolist()) == [0, 2]
    ds.plan.piece_Q[0] = 1  # the empty document's slot (its number): in range, but no piece
    with pytest.raises(ValueError, match=r"pack 0 holds an empty piece\); delete it"):
        ds[0]


def test_pure_modules_never_import_megatron() -> None:
    assert (
        imported_from(
            ["megatron_ext.data.pack_index", "megatron_ext.data.pack_kernel"], ["megatron"]
        )
        == []
    )


def test_the_kernel_is_loaded_only_to_build_an_index(long_corpus, tmp_path, monkeypatch) -> None:
    prefix, _ = long_corpus
    build(prefix, str(tmp_path))  # a cache miss: planned by the kernel

    def no_kernel() -> None:
        raise AssertionError("the pack kernel was asked for")

    monkeypatch.setattr(pack_kernel, "library", no_kernel)
    ds = build(prefix, str(tmp_path))  # config checks and a cache hit plan nothing
    assert ds.cache_hit and len(ds) > 0 and ds[0]["tokens"].numel() == SEQ
