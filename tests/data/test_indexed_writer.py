"""Tests for megatron_ext.data.indexed_writer. Tier: Megatron on one rank (IndexedDataset files)."""

import os

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.data.indexed_writer import write_documents


def test_round_trip_including_2d_payloads(tmp_path) -> None:
    docs = [np.array([5, 6, 7]), np.array([8]), np.array([1, 2])]
    assert write_documents(str(tmp_path / "t"), docs) == 3
    ds = IndexedDataset(str(tmp_path / "t"))
    assert ds.sequence_lengths.tolist() == [3, 1, 2]
    assert [ds[i].tolist() for i in range(3)] == [d.tolist() for d in docs]
    routes = [
        np.array([[1, 2], [3, 4]]),
        np.array([[5, 6]]),
    ]  # [len, W] flattened row-major
    write_documents(str(tmp_path / "r"), routes, dtype=np.int16)
    side = IndexedDataset(str(tmp_path / "r"))
    assert side.sequence_lengths.tolist() == [4, 2] and side[0].dtype == np.int16
    assert side.get(0, offset=2, length=2).tolist() == [3, 4]


def test_rewrite_is_atomic_and_an_open_mmap_keeps_the_old_data(tmp_path) -> None:
    # Rewriting in place truncated the .bin under a job that had it mapped (SIGBUS). Now the
    # new pair is published by rename: the old inode stays intact for its readers.
    prefix = str(tmp_path / "t")
    write_documents(prefix, [np.arange(1000)])
    old = IndexedDataset(prefix)
    inode = os.stat(prefix + ".bin").st_ino
    write_documents(prefix, [np.arange(3)])
    assert os.stat(prefix + ".bin").st_ino != inode
    assert old[0].tolist() == list(range(1000))  # no SIGBUS, the old bytes
    new = IndexedDataset(prefix)  # kept alive: its items are views of its mmap
    assert new[0].tolist() == [0, 1, 2]
    assert sorted(os.listdir(tmp_path)) == ["t.bin", "t.idx"]  # no temporaries left


def test_a_failed_write_leaves_the_old_pair_and_no_temporaries(tmp_path) -> None:
    prefix = str(tmp_path / "t")
    write_documents(prefix, [np.array([7, 8])])

    def docs():
        yield np.array([1, 2])
        raise KeyboardInterrupt  # killed midway

    with pytest.raises(KeyboardInterrupt):
        write_documents(prefix, docs())
    kept = IndexedDataset(prefix)
    assert kept[0].tolist() == [7, 8]
    assert sorted(os.listdir(tmp_path)) == ["t.bin", "t.idx"]


@pytest.mark.parametrize(
    "value, dtype",
    [(-1, np.uint16), (2**31, np.int32), (2**32, np.int32), (1.5, np.int32), (np.nan, np.int32)],
)
def test_values_the_dtype_cannot_hold_are_refused(tmp_path, value, dtype) -> None:
    with pytest.raises(ValueError, match=r"document 1 value 1 is .* cannot store exactly"):
        write_documents(str(tmp_path / "t"), [np.array([1]), np.array([2, value])], dtype=dtype)
    assert os.listdir(tmp_path) == []


def test_companion_files_are_published_with_the_pair(tmp_path) -> None:
    write_documents(str(tmp_path / "r"), [np.array([1])], companions={".h.json": b"{}"})
    assert sorted(os.listdir(tmp_path)) == ["r.bin", "r.h.json", "r.idx"]


def test_a_kill_between_the_renames_leaves_no_pair_that_loads_misaligned(tmp_path, monkeypatch):
    """Same total size, other lengths: the new .bin beside the old .idx would load as wrong
    documents. The old .idx is gone before the first rename, so the prefix refuses to load."""
    prefix = str(tmp_path / "t")
    write_documents(prefix, [np.array([1, 2]), np.array([3, 4, 5, 6, 7, 8])])
    real_replace, renames = os.replace, []

    def killed_after_the_bin(tmp, final):
        if renames:
            raise KeyboardInterrupt
        renames.append(final)
        real_replace(tmp, final)

    monkeypatch.setattr(os, "replace", killed_after_the_bin)
    with pytest.raises(KeyboardInterrupt):
        write_documents(prefix, [np.array([9, 9, 9, 9, 9, 9]), np.array([9, 9])])
    monkeypatch.setattr(os, "replace", real_replace)
    assert renames == [prefix + ".bin"]
    assert not os.path.exists(prefix + ".idx")  # refused at load, not read misaligned
    assert sorted(os.listdir(tmp_path)) == ["t.bin"]  # the temporaries cleaned up too


def test_a_companion_is_in_place_before_the_idx(tmp_path, monkeypatch):
    """A route header published after the .idx could be missing from a pair that loads (a kill
    in between): it goes first, so the prefix loads only with it."""
    prefix = str(tmp_path / "r")
    real_replace, renames = os.replace, []

    def killed_after_two(tmp, final):
        if len(renames) == 2:
            raise KeyboardInterrupt
        renames.append(os.path.basename(final))
        real_replace(tmp, final)

    monkeypatch.setattr(os, "replace", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        write_documents(prefix, [np.array([1])], companions={".h.json": b"{}"})
    assert renames == ["r.bin", "r.h.json"] and not os.path.exists(prefix + ".idx")


def test_streaming_single_documents_equal_write_documents_and_companions_publish(tmp_path):
    """``StreamingPrefixes.add_document`` writes the bytes ``write_documents`` writes (what
    ingest-rollouts relies on for routes equal to convert-routes'); ``finalize`` hands out the
    complete temporary pair before the commit, and companions go in place with their prefix."""
    from megatron_ext.data.indexed_writer import StreamingPrefixes

    docs = [np.arange(3, dtype=np.uint8), np.zeros(0, dtype=np.uint8), np.arange(5, dtype=np.uint8)]
    write_documents(str(tmp_path / "ref"), docs, np.uint8)
    out_prefix = str(tmp_path / "out")
    with StreamingPrefixes([(out_prefix, np.uint8)]) as out:
        for doc in docs:
            out.add_document(0, doc)
        [(tmp_bin, tmp_idx)] = out.finalize()
        assert os.path.getsize(tmp_idx) == os.path.getsize(tmp_path / "ref.idx")
        assert not os.path.exists(out_prefix + ".idx")  # nothing published before the commit
        out.commit({0: {".head.json": b"{}"}})
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"out{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    assert (tmp_path / "out.head.json").read_bytes() == b"{}"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temps


def test_a_token_sidecar_carries_the_header_the_launch_checks(tmp_path) -> None:
    """The header names the token file's digest and the sidecar's shape; the launch's own check
    accepts it for those tokens and refuses it for others."""
    from megatron_ext.data.indexed_writer import write_token_sidecar
    from megatron_ext.data.sidecar_header import check_tokens_digest

    tokens, other = str(tmp_path / "t"), str(tmp_path / "o")
    write_documents(tokens, [np.array([5, 6, 7]), np.array([8, 9])])
    write_documents(other, [np.array([1, 2, 3]), np.array([4, 5])])
    values = [np.array([0.5, 1, 2], np.float32), np.array([-1, 3], np.float32)]
    write_token_sidecar(tokens + "_v", values, tokens, np.array([3, 2]), name="v", scope="token")
    header = check_tokens_digest(tokens + "_v", tokens)
    assert (header["name"], header["scope"], header["dtype"]) == ("v", "token", "float32")
    assert (header["num_documents"], header["num_tokens"]) == (2, 5)
    read = IndexedDataset(tokens + "_v")
    assert [read[d].tolist() for d in range(2)] == [v.tolist() for v in values]
    with pytest.raises(ValueError):
        check_tokens_digest(tokens + "_v", other)
