"""Writes documents (and aligned per-token sidecars) as Megatron IndexedDatasets.

One sequence per document, as ``GPTDataset`` and :class:`~megatron_ext.data.packed_dataset.
PackedDataset` read them. Used by ``tools/preprocess_data.py`` and the tests::

    write_documents("/data/sft_text", [np.array([5, 6, 7]), np.array([8, 9])])
    # -> /data/sft_text.bin, /data/sft_text.idx
"""

from collections.abc import Iterable

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder


def write_documents(
    path_prefix: str, documents: Iterable[np.ndarray], dtype: type[np.number] = np.int32
) -> int:
    """Writes ``documents`` (1-D arrays; 2-D [len, W] are flattened row-major) to
    ``path_prefix.bin`` / ``.idx``.

    Returns:
        The number of documents written.
    """
    builder = IndexedDatasetBuilder(path_prefix + ".bin", dtype=dtype)
    count = 0
    for doc in documents:
        flat = np.ascontiguousarray(np.asarray(doc).reshape(-1), dtype=dtype)
        builder.add_item(torch.from_numpy(flat))
        builder.end_document()
        count += 1
    builder.finalize(path_prefix + ".idx")
    return count
