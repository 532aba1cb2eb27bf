"""Writes documents (and aligned per-token sidecars) as Megatron IndexedDatasets, atomically.

One sequence per document, as ``GPTDataset`` and :class:`~megatron_ext.data.packed_dataset.
PackedDataset` read them. Used by ``tools/preprocess_data.py``, ``tools/convert_routes.py``, route
recording and the tests::

    write_documents("/data/sft_text", [np.array([5, 6, 7]), np.array([8, 9])])
    # -> /data/sft_text.bin, /data/sft_text.idx

Both files are written to temporary files in the target directory and renamed at the end, ``.bin``
before ``.idx`` (:mod:`~megatron_ext.data.safe_files`): a killed writer leaves the old pair intact,
and a job that has the old ``.bin`` memory-mapped keeps its (old) inode. Whether an existing prefix
may be replaced is the caller's decision (the tools refuse it unless ``--overwrite``).
"""

from collections.abc import Iterable

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron_ext.data.safe_files import fsync_path, publish, temp_paths


def write_documents(
    path_prefix: str,
    documents: Iterable[np.ndarray],
    dtype: type[np.number] = np.int32,
    companions: dict[str, bytes] | None = None,
) -> int:
    """Writes ``documents`` (1-D arrays; 2-D [len, W] are flattened row-major) to
    ``path_prefix.bin`` / ``.idx``.

    Args:
        path_prefix: Output prefix.
        documents: One array per document.
        dtype: Stored dtype (one of Megatron's IndexedDataset dtypes). Values are checked to be
            representable: a value that would wrap or round is refused, never stored.
        companions: ``{extension: content}`` files published after the ``.idx`` (e.g. a route
            header ``".routes.json"``).

    Returns:
        The number of documents written.

    Raises:
        ValueError: A value ``dtype`` cannot hold exactly (names the document), or a dtype
            IndexedDataset cannot store.
    """
    dtype = np.dtype(dtype).type
    DType.code_from_dtype(dtype)  # raises for a dtype Megatron cannot read back
    finals = [path_prefix + ".bin", path_prefix + ".idx"]
    finals += [path_prefix + ext for ext in companions or {}]
    with temp_paths(finals) as temps:
        builder = IndexedDatasetBuilder(temps[0], dtype=dtype)
        count = 0
        try:
            for doc in documents:
                values = np.asarray(doc).reshape(-1)
                with np.errstate(invalid="ignore", over="ignore"):
                    flat = np.ascontiguousarray(values, dtype=dtype)
                    exact = values.dtype == dtype or np.array_equal(flat, values)
                if not exact:  # wrapped, rounded or NaN: refuse rather than store another value
                    with np.errstate(invalid="ignore", over="ignore"):
                        i = int(np.flatnonzero(~(flat == values))[0])
                    raise ValueError(
                        f"document {count} value {i} is {values[i]!r}, which "
                        f"{np.dtype(dtype).name} cannot store exactly"
                    )
                builder.add_item(torch.from_numpy(flat))
                builder.end_document()
                count += 1
        finally:
            builder.data_file.close()
        builder.finalize(temps[1])
        for tmp, content in zip(temps[2:], (companions or {}).values(), strict=True):
            with open(tmp, "wb") as f:
                f.write(content)
        for tmp in temps:
            fsync_path(tmp)
        publish(zip(temps, finals, strict=True))
    return count
