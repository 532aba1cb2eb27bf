"""Tests for megatron_ext.data.safe_files. Tier: pure (os + numpy, files)."""

import os
import stat

import numpy as np
import pytest

from megatron_ext.data.safe_files import (
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
    check_output_file(str(tmp_path / "new" / "deep" / "x.json"), flag="--json")  # creatable
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


def test_file_identity_changes_on_atomic_rewrite(tmp_path) -> None:
    path = str(tmp_path / "f")
    atomic_write_bytes(path, b"one")
    before = file_identity(path)
    atomic_write_bytes(path, b"two")  # same size: the inode still differs
    assert file_identity(path) != before
    assert remove_prefix_files(str(tmp_path / "f"), ("",)) == [path]
    assert remove_prefix_files(str(tmp_path / "f"), ("",)) == []
