"""Tests for megatron_ext.data.indexed_writer. Tier: Megatron on one rank (IndexedDataset files)."""

import numpy as np
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
