"""Tests for megatron_ext.data.indexed_checks.open_indexed's checks that an .idx describes its .bin.
Tier: Megatron on one rank (its real IndexedDataset reader on files tools/preprocess_data.py's
writer and Megatron's IndexedDatasetBuilder produce)."""

import gc
import os

import numpy as np
import pytest

from megatron_ext.data.indexed_checks import open_indexed
from megatron_ext.data.indexed_writer import write_documents
from tests.data.dataset_helpers import edit_index, megatron_pair

DOCS = [np.array([104, 105, 256]), np.array([7, 256])]  # 5 tokens


def test_an_empty_bin_is_named_before_megatron_tries_to_map_it(tmp_path, capfd) -> None:
    prefix = str(tmp_path / "empty")
    write_documents(prefix, [])
    with pytest.raises(ValueError, match=rf"^--data-path file {prefix}\.bin is empty: "):
        open_indexed(prefix, "--data-path")
    gc.collect()  # a half-built IndexedDataset would report its failed __del__ now
    assert "Exception ignored" not in capfd.readouterr().err


@pytest.mark.parametrize(
    ("written", "indexed", "diagnosis"),
    [
        (np.uint16, np.int32, "those 5 tokens as 2-byte values"),
        (np.int32, np.uint16, "those 5 tokens as 4-byte values"),
    ],
)
def test_a_bin_of_another_dtype_is_diagnosed(tmp_path, written, indexed, diagnosis) -> None:
    write_documents(str(tmp_path / "a"), DOCS, written)
    write_documents(str(tmp_path / "b"), DOCS, indexed)
    (tmp_path / "mixed.bin").write_bytes((tmp_path / "a.bin").read_bytes())
    (tmp_path / "mixed.idx").write_bytes((tmp_path / "b.idx").read_bytes())
    with pytest.raises(ValueError) as err:
        open_indexed(str(tmp_path / "mixed"), "--data-path")
    assert diagnosis in str(err.value) and "different dtypes" in str(err.value), err.value


def test_a_truncated_bin_is_still_called_truncated(tmp_path) -> None:
    prefix = str(tmp_path / "cut")
    write_documents(prefix, DOCS, np.int32)
    data = (tmp_path / "cut.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-3])  # 17 bytes: no width holds 5 tokens in it
    with pytest.raises(ValueError, match=r"has 17 bytes but .* truncated or corrupt, or the \.idx"):
        open_indexed(prefix, "--data-path")


def test_a_foreign_idx_of_the_same_size_is_refused_naming_it(tmp_path) -> None:
    """Another corpus's .idx with the same sequence and document counts has the same byte size;
    its lengths add up to another .bin size. The message names the .idx as a suspect, not only
    the .bin as truncated (a user told the .bin is broken rewrites the good file)."""
    megatron_pair(tmp_path / "ours", [3, 5, 2], [2, 1])
    megatron_pair(tmp_path / "other", [4, 4, 4], [2, 1])
    ours, other = (tmp_path / "ours.idx").read_bytes(), (tmp_path / "other.idx").read_bytes()
    assert len(ours) == len(other) and ours != other  # the case: same size, other content
    (tmp_path / "mixed.bin").write_bytes((tmp_path / "ours.bin").read_bytes())
    (tmp_path / "mixed.idx").write_bytes(other)
    with pytest.raises(ValueError) as err:
        open_indexed(str(tmp_path / "mixed"), "--data-path")
    message = str(err.value)
    assert f"{tmp_path}/mixed.bin has 20 bytes but {tmp_path}/mixed.idx indexes 24" in message
    assert "or the .idx is another .bin's" in message and "\n" not in message, message


@pytest.mark.parametrize(
    ("field", "values", "cause"),
    [
        # lengths [3, 5, 2] -> [5, 3, 2]: same total, so the .bin size (and the last pointer plus
        # the last length, all the old check read) still match; sequence 1's pointer does not.
        (
            "lengths",
            [5, 3],
            r"sequence 1 starts at byte 6 but the lengths before it end at byte 10",
        ),
        ("lengths", [-3, 11], r"sequence 0 has length -3"),
        ("documents", [0, 2, 1, 3], r"document index 2 \(1\) is below index 1 \(2\)"),
        ("documents", [1, 1, 2, 3], r"document indices run from 1 to 3, not from 0 to its 3"),
    ],
)
def test_an_idx_that_disagrees_with_itself_is_refused(tmp_path, field, values, cause) -> None:
    prefix = tmp_path / "d"
    megatron_pair(prefix, [3, 5, 2], [1, 1, 1])
    before = os.path.getsize(str(prefix) + ".idx")
    edit_index(prefix, field, values)
    assert os.path.getsize(str(prefix) + ".idx") == before  # same size, other content
    with pytest.raises(
        ValueError,
        match=rf"^--data-path file {prefix}\.idx does not describe "
        rf"{prefix}\.bin: its {cause}",
    ):
        open_indexed(str(prefix), "--data-path")


def test_an_idx_longer_than_its_header_says_is_refused(tmp_path) -> None:
    prefix = tmp_path / "d"
    megatron_pair(prefix, [3, 5, 2], [1, 1, 1])
    with open(str(prefix) + ".idx", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(
        ValueError,
        match=r"d\.idx has 110 bytes but its header counts 3 sequences "
        r"and 4 document indices \(102 bytes\)",
    ):
        open_indexed(str(prefix), "--data-path")


def test_megatrons_bare_assert_on_an_idx_is_named_by_its_line(tmp_path) -> None:
    """Megatron's IndexedDataset asserts the last document index is the sequence count with no
    message; the error quotes the failing line instead of ending in 'is corrupt: '."""
    prefix = tmp_path / "d"
    megatron_pair(prefix, [3, 5, 2], [1, 1, 1])
    edit_index(prefix, "documents", [0, 1, 2, 2])
    with pytest.raises(
        ValueError,
        match=r"d\.idx/\.bin is corrupt: Megatron's reader failed "
        r"assert .*document_indices\[-1\]",
    ):
        open_indexed(str(prefix), "--data-path")
