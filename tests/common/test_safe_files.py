"""Tests for megatron_ext.common.safe_files. Tier: pure (os + numpy, files)."""

import hashlib
import os
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron_ext.common.safe_files import (
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


def test_a_fresh_output_another_writer_published_meanwhile_is_not_replaced(tmp_path) -> None:
    """Two writers of one fresh prefix: this one checks it (absent), the other -- the real
    tools/preprocess_data.py, in its own process -- writes it completely, then this one
    publishes. Its publication fails naming the file; the other's pair is left intact."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.data.indexed_writer import write_documents

    prefix = str(tmp_path / "out")
    check_output_prefix(prefix, flag="--output-prefix")
    (tmp_path / "in.jsonl").write_text('{"text": "the other writer"}\n')
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run(
        [sys.executable, os.path.join(root, "tools", "preprocess_data.py"),
         "--input", str(tmp_path / "in.jsonl"), "--output-prefix", prefix],
        check=True, capture_output=True,
    )  # fmt: skip
    theirs = {ext: (tmp_path / f"out{ext}").read_bytes() for ext in (".bin", ".idx")}
    with pytest.raises(ValueError, match=rf"^{prefix}\.bin was created by another writer"):
        write_documents(prefix, [np.array([1, 2, 3])])
    assert {ext: (tmp_path / f"out{ext}").read_bytes() for ext in (".bin", ".idx")} == theirs
    assert len(IndexedDataset(prefix)[0]) == len("the other writer")
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.bin", "out.idx"]  # no temporaries


def test_a_commit_that_meets_another_writers_idx_takes_its_own_files_back(tmp_path) -> None:
    """The other writer got its .idx in first, this one its .bin: this one's .bin is unlinked
    again (by inode: only its own), so no prefix pairs this .bin with that .idx."""
    from megatron_ext.data.indexed_writer import write_documents

    prefix = str(tmp_path / "out")
    check_output_prefix(prefix, flag="--output-prefix")
    (tmp_path / "out.idx").write_bytes(b"the other writer's index")
    with pytest.raises(ValueError, match=rf"^{prefix}\.idx was created by another writer"):
        write_documents(prefix, [np.array([1, 2, 3])])
    assert sorted(os.listdir(tmp_path)) == ["out.idx"]
    assert (tmp_path / "out.idx").read_bytes() == b"the other writer's index"


def test_a_single_file_output_is_not_replaced_either_but_overwrite_replaces(tmp_path) -> None:
    path = str(tmp_path / "report.json")
    check_output_file(path, flag="--json")
    (tmp_path / "report.json").write_bytes(b"theirs")
    with pytest.raises(ValueError, match="was created by another writer"):
        atomic_write_bytes(path, b"mine")
    assert (tmp_path / "report.json").read_bytes() == b"theirs"
    assert os.listdir(tmp_path) == ["report.json"]
    check_output_file(path, flag="--json", overwrite=True)  # exists and may be replaced
    atomic_write_bytes(path, b"mine")
    assert (tmp_path / "report.json").read_bytes() == b"mine"
    atomic_write_bytes(path, b"again")  # published once: later writes replace, as caches do
    assert (tmp_path / "report.json").read_bytes() == b"again"


def test_every_rename_into_place_goes_through_put_in_place() -> None:
    """One publish: outside common/ no module renames a file into place itself (``os.replace``
    or ``os.rename``); each calls put_in_place, directly or through atomic_write_bytes/publish."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "megatron_ext"
    sources = sorted(package.rglob("*.py"))
    assert len(sources) > 50  # the package, not an empty directory
    renaming = {
        path.relative_to(package).as_posix()
        for path in sources
        if "os.replace(" in path.read_text() or "os.rename(" in path.read_text()
    }
    assert renaming == {"common/safe_files.py", "common/temp_names.py"}
