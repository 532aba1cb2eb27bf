"""Tests for megatron_ext.data.safe_files. Tier: pure (os + numpy, files)."""

import hashlib
import os
import stat
import time

import numpy as np
import pytest

from megatron_ext.data.safe_files import (
    FINGERPRINT_CHUNK_VALUES,
    atomic_write_bytes,
    check_output_file,
    check_output_prefix,
    create_temp,
    file_identity,
    lengths_fingerprint,
    remove_prefix_files,
)


def test_temp_files_follow_the_umask_not_mkstemps_0600(tmp_path) -> None:
    old = os.umask(0o022)
    try:
        fd, tmp = create_temp(str(tmp_path / "x"))
        os.close(fd)
        atomic_write_bytes(str(tmp_path / "y"), b"data")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp).st_mode) == 0o644  # group and others may read
    assert stat.S_IMODE(os.stat(tmp_path / "y").st_mode) == 0o644
    assert (tmp_path / "y").read_bytes() == b"data"
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(tmp), "y"])


def test_existing_outputs_and_inputs_are_refused(tmp_path) -> None:
    prefix = str(tmp_path / "out")
    check_output_prefix(prefix, flag="--output-prefix")  # fresh: fine
    (tmp_path / "out.idx").write_bytes(b"old")
    with pytest.raises(ValueError, match=r"--output-prefix .*out\.idx already exists; pass "):
        check_output_prefix(prefix, flag="--output-prefix")
    check_output_prefix(prefix, flag="--output-prefix", overwrite=True)
    # Equal to an input prefix: refused even with --overwrite.
    with pytest.raises(ValueError, match=r"out\.idx is an input"):
        check_output_prefix(prefix, flag="--output-prefix", inputs=[prefix], overwrite=True)
    link = tmp_path / "alias.json"
    link.symlink_to(tmp_path / "out.idx")
    with pytest.raises(ValueError, match="is an input"):
        check_output_file(str(link), flag="--json", inputs=[str(tmp_path / "out.idx")])
    for bad in ("", str(tmp_path) + os.sep):
        with pytest.raises(ValueError, match="must name a file prefix"):
            check_output_prefix(bad, flag="--output-prefix")


def test_unwritable_places_are_refused_before_the_work(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"--png .*file is a file, not a directory"):
        check_output_file(str(tmp_path / "file" / "plot.png"), flag="--png")
    with pytest.raises(ValueError, match=r"--json .* is a directory"):
        check_output_file(str(tmp_path), flag="--json", overwrite=True)
    deep = tmp_path / "new" / "deep" / "x.json"
    check_output_file(str(deep), flag="--json")  # creatable: allowed, so the write creates it
    atomic_write_bytes(str(deep), b"{}")
    assert deep.read_bytes() == b"{}" and os.listdir(deep.parent) == ["x.json"]
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="is not writable"):
            check_output_file(str(ro / "x.json"), flag="--json")


def test_identities_change_with_the_data() -> None:
    a = lengths_fingerprint(np.array([3, 4, 5], np.int32))
    assert a == lengths_fingerprint(np.array([3, 4, 5], np.int64))  # dtype-independent
    assert a.startswith("3:") and a != lengths_fingerprint(np.array([3, 5, 4]))
    assert lengths_fingerprint(np.array([3, 4])) != lengths_fingerprint(np.array([3, 4, 0]))


def _fingerprint_with_a_whole_copy(lengths) -> str:
    """The formula caches were keyed by before the chunked hash: must stay bit-identical."""
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    return f"{lengths.size}:{hashlib.blake2b(lengths.tobytes(), digest_size=16).hexdigest()}"


_CHUNK = FINGERPRINT_CHUNK_VALUES


@pytest.mark.parametrize(
    "make",
    [
        lambda rng: np.array([], np.int32),  # empty
        lambda rng: np.zeros((0, 3), np.int64),  # empty, 2-d
        lambda rng: np.int32(7),  # a 0-d scalar
        lambda rng: [3, 4, 5],  # a list
        lambda rng: rng.integers(0, 1 << 20, 3 * _CHUNK + 1).astype(np.int32),  # .idx dtype
        lambda rng: rng.integers(0, 1 << 40, _CHUNK + 5),  # int64: hashed from its buffer
        lambda rng: np.array([-1, 2**63 - 1], np.int64),
        lambda rng: rng.integers(0, 1000, (300, 500)).astype(np.uint16),  # 2-d, C order
        lambda rng: rng.integers(0, 1000, (300, 500))[:, ::3],  # int64, not contiguous
        lambda rng: rng.integers(0, 1000, (300, 500)).astype(np.int32).T,  # Fortran order
        lambda rng: rng.integers(0, 1000, 2 * _CHUNK).astype(">i8"),  # int64, other byte order
        lambda rng: rng.integers(0, 1 << 62, 1000).astype(np.uint64),
        lambda rng: np.array([True, False, True]),
    ],
)
def test_fingerprint_is_bit_identical_to_the_whole_copy_formula(make) -> None:
    lengths = make(np.random.default_rng(0))
    assert lengths_fingerprint(lengths) == _fingerprint_with_a_whole_copy(lengths)


def test_fingerprint_chunks_cover_the_chunk_edges() -> None:
    # Guard against a vacuous chunk loop: the inputs above do span several chunks, and a change
    # in the last value of a chunk or the first of the next changes the fingerprint.
    lengths = np.arange(2 * _CHUNK + 3, dtype=np.int32)
    base = lengths_fingerprint(lengths)
    for index in (_CHUNK - 1, _CHUNK, 2 * _CHUNK + 2):
        changed = lengths.copy()
        changed[index] += 1
        assert lengths_fingerprint(changed) == _fingerprint_with_a_whole_copy(changed) != base


def test_file_identity_changes_on_atomic_rewrite(tmp_path) -> None:
    path = str(tmp_path / "f")
    atomic_write_bytes(path, b"one")
    before = file_identity(path)
    atomic_write_bytes(path, b"two")  # same size: the inode still differs
    assert file_identity(path) != before
    # In place, same size, the mtime set back (os.utime, cp -p): the ctime still moves.
    stamped = os.stat(path)
    kept = file_identity(path)
    for _ in range(300):  # until the clock the filesystem stamps with has moved (ns on most)
        time.sleep(0.01)
        with open(path, "r+b") as f:
            f.write(b"TWO")
        os.utime(path, ns=(stamped.st_atime_ns, stamped.st_mtime_ns))
        if os.stat(path).st_ctime_ns != stamped.st_ctime_ns:
            break
    assert os.stat(path).st_mtime_ns == stamped.st_mtime_ns  # what the old key saw: unchanged
    assert file_identity(path) != kept
    assert remove_prefix_files(str(tmp_path / "f"), ("",)) == [path]
    assert remove_prefix_files(str(tmp_path / "f"), ("",)) == []
