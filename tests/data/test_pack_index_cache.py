"""Tests for megatron_ext.data.pack_index_cache. Tier: pure (numpy + files, threads)."""

import os
import threading

import numpy as np
import pytest

from megatron_ext.data import pack_index_cache
from megatron_ext.data.pack_index_cache import (
    cache_path,
    load,
    load_or_build,
    mark_validated,
    save_atomically,
    validated,
)


def test_round_trip_and_cache_hit(tmp_path) -> None:
    path = cache_path(str(tmp_path / "c"), "abc", "PackedDataset", "train")
    assert path.endswith("abc-PackedDataset-train-packs.npz")
    calls = []

    def build() -> dict:
        calls.append(1)
        return {
            "pack_offsets_P1": np.array([0, 2, 3]),
            "piece_len_Q": np.array([4, 5, 6]),
        }

    first, hit1 = load_or_build(path, build, "desc", ("pack_offsets_P1",))
    second, hit2 = load_or_build(path, build, "desc", ("pack_offsets_P1",))
    assert (hit1, hit2) == (False, True) and len(calls) == 1
    assert second.keys() == first.keys()
    assert all(np.array_equal(first[k], second[k]) for k in first)
    assert os.listdir(tmp_path / "c") == [os.path.basename(path)]  # no temp files left
    _uncached, hit = load_or_build(None, build, "desc")
    assert not hit and len(calls) == 2


def test_concurrent_writers_leave_one_valid_file(tmp_path) -> None:
    """Writers racing on one cache (ranks building the same index) while a reader loads it: the
    reader only ever sees one writer's whole file, and one whole file is left. Each writer
    writes different bytes, so a mix or a partial file would show."""
    path = str(tmp_path / "x-packs.npz")
    arrays = [{"a": np.full(400_000, i, dtype=np.int64)} for i in range(6)]
    save_atomically(path, arrays[0], "d")
    start = threading.Barrier(len(arrays) + 1)
    writing = threading.Event()
    seen, bad = [], []

    def write(a) -> None:
        start.wait()
        for _ in range(5):
            save_atomically(path, a, "d")

    def read() -> None:
        start.wait()
        while writing.is_set():
            try:
                got = load(path, ("a",))["a"]
            except Exception as err:  # noqa: BLE001 - any failure to read is the defect
                bad.append(repr(err))
                continue
            seen.append(int(got[0]))
            if not any(np.array_equal(got, a["a"]) for a in arrays):
                bad.append("mixed content")

    writing.set()
    writers = [threading.Thread(target=write, args=(a,)) for a in arrays]
    reader = threading.Thread(target=read)
    for t in [*writers, reader]:
        t.start()
    for t in writers:
        t.join()
    writing.clear()
    reader.join()
    assert bad == [] and len(seen) > 0, bad[:3]
    got = load(path, ("a",))["a"]
    assert any(np.array_equal(got, a["a"]) for a in arrays)
    assert os.listdir(tmp_path) == ["x-packs.npz"]


def test_killed_writer_leaves_no_cache(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "k-packs.npz")

    def dies_midway(f, **arrays) -> None:  # a writer killed after writing part of the file
        f.write(b"PK partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(pack_index_cache.np, "savez", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        save_atomically(path, {"a": np.arange(3)}, "d")
    monkeypatch.undo()
    assert not os.path.exists(path)  # readers never see a partial cache
    _arrays, hit = load_or_build(path, lambda: {"a": np.arange(3)}, "d")
    assert not hit and np.array_equal(load(path)["a"], np.arange(3))


def test_bad_cache_files_are_named(tmp_path) -> None:
    path = str(tmp_path / "bad-packs.npz")
    with open(path, "wb") as f:
        f.write(b"\x00garbage")
    with pytest.raises(ValueError, match=f"pack-index cache {path} is corrupt"):
        load(path)
    save_atomically(path, {"a": np.arange(3)}, "d")
    with pytest.raises(ValueError, match=r"lacks \['b'\]"):
        load(path, ("a", "b"))


def test_a_cache_built_for_another_description_is_rebuilt_not_reused(tmp_path) -> None:
    path = str(tmp_path / "h-packs.npz")
    save_atomically(path, {"a": np.arange(3)}, "data identity 60:abc")
    arrays, hit = load_or_build(path, lambda: {"a": np.arange(5)}, "data identity 31:def")
    assert not hit and np.array_equal(arrays["a"], np.arange(5))
    assert np.array_equal(load(path)["a"], np.arange(5))  # replaced on disk too
    _, hit = load_or_build(path, lambda: {"a": np.arange(9)}, "data identity 31:def")
    assert hit


def test_cache_files_are_group_readable(tmp_path) -> None:
    old = os.umask(0o027)
    try:
        save_atomically(str(tmp_path / "g-packs.npz"), {"a": np.arange(3)}, "d")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "g-packs.npz").st_mode & 0o777 == 0o640  # mkstemp gave 0o600


def test_validation_markers_are_keyed_by_their_text(tmp_path) -> None:
    cache = str(tmp_path / "c")
    assert not validated(cache, "routes ino:1") and not validated(None, "x")
    mark_validated(cache, "routes ino:1")
    assert validated(cache, "routes ino:1") and not validated(cache, "routes ino:2")
    mark_validated(None, "x")  # no cache directory: nothing recorded, nothing raised


def test_unwritable_cache_directory_suggests_data_cache_path(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="--data-cache-path"):
        save_atomically(str(tmp_path / "file" / "c" / "p.npz"), {"a": np.arange(1)}, "d")


def test_a_full_disk_mid_write_is_one_error_naming_the_cache_and_leaves_nothing(tmp_path) -> None:
    """A real failed write: the file-size limit makes the kernel refuse the write (EFBIG, as a
    full disk refuses with ENOSPC) partway through the array, inside numpy's own savez."""
    import resource
    import signal

    path = str(tmp_path / "c" / "big-packs.npz")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, hard))
    try:
        with pytest.raises(ValueError) as err:
            save_atomically(path, {"a": np.arange(1 << 16)}, "d")  # 512 KiB > 64 KiB
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    message = str(err.value)
    assert message.startswith(f"cannot write the index cache {path} (File too large)"), message
    assert "--data-cache-path" in message and "\n" not in message
    assert isinstance(err.value.__cause__, OSError)
    assert os.listdir(tmp_path / "c") == []  # neither the cache nor its temporary file


def test_a_scans_integers_come_back_only_under_their_key_and_count(tmp_path) -> None:
    cache = str(tmp_path / "cache")
    assert pack_index_cache.recall_ints(cache, "scan a", 2) is None  # nothing stored yet
    pack_index_cache.remember_ints(cache, "scan a", (-1, 12))
    assert pack_index_cache.recall_ints(cache, "scan a", 2) == (-1, 12)  # -1: an empty file's id
    assert pack_index_cache.recall_ints(cache, "scan a", 1) is None  # another layout
    assert pack_index_cache.recall_ints(cache, "scan b", 2) is None  # another scan or file state
    pack_index_cache.remember(cache, "scan c", "12 x")  # not integers: read as absent
    assert pack_index_cache.recall_ints(cache, "scan c", 2) is None
    assert pack_index_cache.recall_ints(None, "scan a", 2) is None  # no cache directory
