"""Tests for megatron_ext.data.indexed_checks.open_indexed's size checks. Tier: Megatron on one rank
(its real IndexedDataset reader on files tools/preprocess_data.py's writer produces)."""

import gc

import numpy as np
import pytest

from megatron_ext.data.indexed_checks import open_indexed
from megatron_ext.data.indexed_writer import write_documents

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
    with pytest.raises(ValueError, match=r"has 17 bytes but .* truncated or corrupt; rewrite it"):
        open_indexed(prefix, "--data-path")
