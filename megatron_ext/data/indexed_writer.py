"""Writes documents (and aligned per-token sidecars) as Megatron IndexedDatasets, atomically.

One sequence per document, as ``GPTDataset`` and ``PackedDataset`` read them (``StreamingPrefixes``:
any number, as Megatron's ``add_document`` records them)::

    write_documents("/data/sft_text", [np.array([5, 6, 7]), np.array([8, 9])])
    # -> /data/sft_text.bin, /data/sft_text.idx
"""

import contextlib
import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron_ext.common.safe_files import fsync_path, publish, remove_prefix_files, temp_paths


def write_documents(
    path_prefix: str,
    documents: Iterable[np.ndarray],
    dtype: type[np.number] = np.int32,
    companions: dict[str, bytes | Callable[[], bytes]] | None = None,
) -> int:
    """Writes ``documents`` (one array each; [len, W] flattened row-major) to ``path_prefix``
    ``.bin``/``.idx``; returns the number written.

    Args:
        dtype: Stored dtype; a value it cannot hold exactly is refused (ValueError), never stored.
        companions: ``{extension: content}`` files published before the ``.idx`` (e.g. a route
            header ``".routes.json"``); a content may be a function returning the bytes, called
            once every document is written (a header that counts streamed documents).
    """
    return write_prefixes([(path_prefix, documents, dtype, companions)])[0]


def write_token_sidecar(
    path_prefix: str,
    documents: Iterable[np.ndarray],
    tokens_prefix: str,
    lengths_D: np.ndarray,
    *,
    name: str,
    scope: str,
    dtype: type[np.number] = np.float32,
) -> int:
    """Writes ``documents`` (``lengths_D[d]`` values each) as a per-token sidecar of the token
    dataset at ``tokens_prefix``, with its ``.sidecar.json`` header naming the tokens' digest."""
    from megatron_ext.common.safe_files import content_digest
    from megatron_ext.data.sidecar_header import SIDECAR_EXTENSION, sidecar_header_bytes

    header = sidecar_header_bytes(
        name=name,
        key=None,
        scope=scope,
        dtype=dtype,
        lengths_D=lengths_D,
        tokens_digest=content_digest([tokens_prefix + ".idx", tokens_prefix + ".bin"]),
    )
    return write_documents(path_prefix, documents, dtype, companions={SIDECAR_EXTENSION: header})


def write_prefixes(
    outputs: Sequence[tuple[str, Iterable[np.ndarray], type[np.number], dict[str, bytes] | None]],
    remove: Sequence[str] = (),
) -> list[int]:
    """Writes several aligned prefixes (a token dataset and its per-token sidecars) as one commit.

    Every prefix is written to temporary files first (a bad value stops the run with nothing
    changed), then the old files and the ``remove`` prefixes' (a stale sidecar) are removed and
    the new ones renamed into place.

    Args:
        outputs: ``(path_prefix, documents, dtype, companions)`` per prefix, as
            :func:`write_documents` takes them.
        remove: Prefixes whose files are deleted in the same commit (never one of ``outputs``).
    """
    # Whether an existing prefix may be replaced is the caller's decision (the tools refuse it
    # unless --overwrite): here it is replaced.
    outputs = list(outputs)
    prefixes = [prefix for prefix, *_ in outputs]
    both = set(map(os.path.abspath, remove)) & set(map(os.path.abspath, prefixes))
    if both:
        raise ValueError(f"cannot both write and remove {sorted(both)}")
    finals_per = [
        [prefix + ".bin", prefix + ".idx", *(prefix + ext for ext in companions or {})]
        for prefix, _docs, _dtype, companions in outputs
    ]
    finals = [final for group in finals_per for final in group]
    counts = []
    with temp_paths(finals) as temps:
        start = 0
        for (_prefix, documents, dtype, companions), group in zip(outputs, finals_per, strict=True):
            counts.append(
                _write_temps(temps[start : start + len(group)], documents, dtype, companions)
            )
            start += len(group)
        for tmp in temps:
            fsync_path(tmp)
        for stale in remove:
            remove_prefix_files(stale)
        # .bin before .idx (safe_files.publish): a writer killed before leaves the old pair, one
        # killed during it a prefix without its .idx, refused at load (never new tokens beside an
        # old sidecar that would load), and a job mapping the old .bin keeps its inode.
        publish(zip(temps, finals, strict=True))  # every .idx last
    return counts


def _write_temps(
    temps: list[str],
    documents: Iterable[np.ndarray],
    dtype: type[np.number],
    companions: dict[str, bytes] | None,
) -> int:
    """Fills one prefix's temporary ``.bin``, ``.idx`` and companions; returns its document count."""
    dtype = np.dtype(dtype).type
    DType.code_from_dtype(dtype)  # raises for a dtype Megatron cannot read back
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
    # Companions after the documents: a callable one (a header counting streamed documents) sees
    # them all.
    for tmp, content in zip(temps[2:], (companions or {}).values(), strict=True):
        with open(tmp, "wb") as f:
            f.write(content() if callable(content) else content)
    return count


class StreamingPrefixes:
    """Megatron ``IndexedDatasetBuilder`` s on temporary files, one per output prefix, published
    together by :meth:`commit` (nothing if the ``with`` block raises); no token data in memory::

        with StreamingPrefixes([("/d/x_text_document", np.uint16)]) as out:
            out.add_documents(0, ids, seq_lens, doc_seqs)
            out.commit()
    """

    def __init__(
        self, outputs: Sequence[tuple[str, type[np.number]]], remove: Sequence[str] = ()
    ) -> None:
        self.prefixes = [prefix for prefix, _dtype in outputs]
        self.dtypes = [np.dtype(dtype).type for _prefix, dtype in outputs]
        self.remove = list(remove)
        self.finals = [p + ext for p in self.prefixes for ext in (".bin", ".idx")]
        self._stack = contextlib.ExitStack()
        self.builders: list[IndexedDatasetBuilder] = []

    def __enter__(self) -> "StreamingPrefixes":
        self.temps = self._stack.enter_context(temp_paths(self.finals))
        for i, dtype in enumerate(self.dtypes):
            DType.code_from_dtype(dtype)  # raises for a dtype Megatron cannot read back
            self.builders.append(IndexedDatasetBuilder(self.temps[2 * i], dtype=dtype))
        return self

    def __exit__(self, *exc) -> None:
        for builder in self.builders:
            builder.data_file.close()
        self._stack.close()

    def add_documents(
        self, output: int, ids: np.ndarray, seq_lens: np.ndarray, doc_seqs: np.ndarray
    ) -> None:
        """Appends documents to output ``output``: ``ids`` concatenated, ``seq_lens`` of every
        sequence, ``doc_seqs`` sequences per document (0: an empty document)."""
        builder = self.builders[output]
        seq_ends = np.cumsum(seq_lens).tolist()
        lens = seq_lens.tolist()
        s = t = 0
        for n in doc_seqs.tolist():
            end = seq_ends[s + n - 1] if n else t
            builder.add_document(ids[t:end], lens[s : s + n])
            s, t = s + n, end

    def add_document(self, output: int, values: np.ndarray) -> None:
        """Appends one document of one sequence (``values`` flattened) to output ``output``; the
        caller has checked that the output's dtype holds the values exactly."""
        flat = np.ascontiguousarray(np.asarray(values).reshape(-1), dtype=self.dtypes[output])
        self.builders[output].add_document(flat, [flat.size])

    def finalize(self) -> list[tuple[str, str]]:
        """Writes every output's index (once); returns each output's temporary ``(.bin, .idx)``,
        complete from now on (e.g. to digest the tokens before a companion names them)."""
        if not getattr(self, "_finalized", False):
            for builder, idx in zip(self.builders, self.temps[1::2], strict=True):
                builder.finalize(idx)
            self._finalized = True
        return list(zip(self.temps[0::2], self.temps[1::2], strict=True))

    def add_index(self, output: int, path_prefix: str) -> None:
        """Appends a whole IndexedDataset (Megatron's ``IndexedDatasetBuilder.add_index``)."""
        self.builders[output].add_index(path_prefix)

    def commit(self, companions: dict[int, dict[str, bytes]] | None = None) -> None:
        """Writes the indexes and puts every output in place (see :func:`write_prefixes`), with
        ``companions[output]`` = ``{extension: content}`` files beside that output's prefix
        (a header), published before its ``.idx``."""
        self.finalize()
        temps, finals = list(self.temps), list(self.finals)
        extra = [
            (self.prefixes[output] + ext, content)
            for output, files in (companions or {}).items()
            for ext, content in files.items()
        ]
        if extra:
            extra_temps = self._stack.enter_context(temp_paths([final for final, _ in extra]))
            for tmp, (_final, content) in zip(extra_temps, extra, strict=True):
                with open(tmp, "wb") as f:
                    f.write(content)
            temps += extra_temps
            finals += [final for final, _ in extra]
        for tmp in temps:
            fsync_path(tmp)
        for stale in self.remove:
            remove_prefix_files(stale)
        publish(zip(temps, finals, strict=True))  # every .idx last
