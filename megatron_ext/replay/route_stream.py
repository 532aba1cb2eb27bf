"""Recording routes at any scale: per-rank streams on disk, assembled into a route sidecar (pure
numpy + os, never imports megatron).

Each data-parallel rank appends what it records to a stream of its own (``B.pieces``: int64
``[doc, start, length]`` per piece; ``B.rows``: their route rows), assembled into the sidecar at the
end by streaming: peak RAM is one micro-batch plus fixed buffers, whatever the recording's size (in
host RAM it was ``L * K`` bytes per token: about 3 TiB for 10M documents at 48 layers, top-8)::

    pack pieces [(doc 4, start 0, len 3), (doc 7, start 10, len 2)], routes_SLK [r0 r1 r2 r3 r4 _ _]
    B.pieces += [[4, 0, 3], [7, 10, 2]]     B.rows += r0 r1 r2 r3 r4     (pads are not documents)
    sidecar: doc 4 tokens 0..2 <- r0 r1 r2, doc 7 tokens 10..11 <- r3 r4, every other token missing

Legend: S positions of a pack, Q pieces, L MoE layers, K top-k, D documents.
"""

import os
import struct
from collections.abc import Sequence

import numpy as np

from megatron_ext.common.safe_files import check_output_prefix, fsync_path, publish, temp_paths
from megatron_ext.data.padding import real_positions
from megatron_ext.replay.route_file import HEADER_EXTENSION, header_bytes, tokens_digest
from megatron_ext.replay.routes import missing_value, route_dtype

#: Bytes the assembly reads or writes at a time (fill, rows, index); pieces read per chunk.
CHUNK_BYTES = 1 << 20
PIECES_PER_READ = 4096
#: Megatron's ``.idx`` layout (``megatron.core.datasets.indexed_dataset._IndexWriter``).
_INDEX_HEADER = b"MMIDIDX\x00\x00"
_DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.uint16): 8}
_INT32_MAX = np.iinfo(np.int32).max


def stream_files(base: str) -> tuple[str, str]:
    """``(pieces, rows)`` paths of stream ``base``."""
    return base + ".pieces", base + ".rows"


class RouteStream:
    """Appends recorded packs to stream ``base`` (truncating a stale one of a killed run), rows
    of L MoE layers x top-K over E experts."""

    def __init__(self, base: str, num_layers: int, topk: int, num_experts: int) -> None:
        self.base = base
        self.dtype = route_dtype(num_experts, topk)
        self.row_shape = (num_layers, topk)
        pieces, rows = stream_files(base)
        self._pieces = open(pieces, "wb")  # noqa: SIM115 - kept open while recording
        self._rows = open(rows, "wb")  # noqa: SIM115
        self.recorded_tokens = 0

    def add_pack(
        self,
        pieces: tuple[np.ndarray, np.ndarray, np.ndarray],
        routes_SLK: np.ndarray,
        pad_mask_S: np.ndarray | None = None,
        doc_multiple: int = 1,
    ) -> None:
        """Appends one pack: its pieces ``(doc_Q, start_Q, len_Q)`` and the rows of its real
        positions in ``routes_SLK`` (laid out by ``doc_multiple``, 2*CP under CP); rows where
        ``pad_mask_S`` is True are written as missing."""
        doc_Q, start_Q, len_Q = (np.asarray(a, dtype=np.int64) for a in pieces)
        num_real = int(len_Q.sum())
        if routes_SLK.ndim != 3 or routes_SLK.shape[1:] != self.row_shape:
            raise ValueError(
                f"recorded routes are {routes_SLK.shape}, expected [S, {self.row_shape[0]}, "
                f"{self.row_shape[1]}]"
            )
        if routes_SLK.dtype != self.dtype:
            raise ValueError(f"recorded routes are {routes_SLK.dtype}, expected {self.dtype}")
        # Only real tokens are documents: a recording at CP 2 equals one at CP 1.
        real_N = real_positions(len_Q, doc_multiple)
        if num_real and real_N[-1] >= routes_SLK.shape[0]:
            raise ValueError(
                f"pack holds {num_real} real tokens (to position {int(real_N[-1])}) but "
                f"{routes_SLK.shape[0]} routes"
            )
        rows_NLK = np.ascontiguousarray(routes_SLK[real_N])
        # A "skip pads" MoE layer gives pads no expert: what it chose is no route.
        pads_N = None if pad_mask_S is None else np.asarray(pad_mask_S, dtype=bool)[real_N]
        if pads_N is not None and pads_N.any():
            rows_NLK = rows_NLK.copy()  # never the caller's array
            rows_NLK[pads_N] = missing_value(self.dtype)
        self._pieces.write(np.stack([doc_Q, start_Q, len_Q], axis=1).tobytes())
        self._rows.write(memoryview(rows_NLK).cast("B"))
        self.recorded_tokens += num_real - (0 if pads_N is None else int(pads_N.sum()))

    def close(self) -> None:
        """Flushes and closes both files (the stream can then be assembled)."""
        for f in (self._pieces, self._rows):
            if not f.closed:
                f.flush()
                os.fsync(f.fileno())
                f.close()


def remove_stream(base: str) -> None:
    """Deletes both files of stream ``base`` (missing ones are ignored)."""
    for path in stream_files(base):
        if os.path.exists(path):
            os.unlink(path)


def assemble_route_sidecar(
    path_prefix: str,
    streams: Sequence[str],
    *,
    doc_lengths_D: np.ndarray,
    doc_offsets_D: np.ndarray | None = None,
    offset_unit: int = 1,
    num_layers: int,
    topk: int,
    num_experts: int,
    overwrite: bool = False,
    flag: str = "--route-record-path",
    tokens_prefix: str | None = None,
    moe_layer_ids: Sequence[int] | None = None,
) -> int:
    """Writes the route sidecar of the documents from closed streams; returns the documents.

    Args:
        streams: Stream bases in precedence order (data-parallel rank order; later ones win).
        doc_lengths_D: Token count per document (may be memory-mapped: read in chunks).
        doc_offsets_D: Each document's offset in the token ``.bin`` in units of ``offset_unit``
            (Megatron's ``sequence_pointers``: read per piece); None: from the lengths.
        overwrite, flag: Replace an existing output (else ValueError naming ``flag``).
        tokens_prefix, moe_layer_ids: For the header (the token data recorded on, the rows'
            decoder layers).

    Raises:
        ValueError: An existing output, a missing stream, or a piece outside its document.
    """
    dtype = route_dtype(num_experts, topk)
    exts = (".bin", ".idx", HEADER_EXTENSION)
    check_output_prefix(path_prefix, flag=flag, overwrite=overwrite, extensions=exts)
    # Read after the output check passes (a refused run reads no token data).
    tokens = None if tokens_prefix is None else tokens_digest(tokens_prefix)
    _check_streams(streams, flag)
    row_bytes = num_layers * topk * dtype.itemsize
    finals = [path_prefix + ext for ext in exts]
    # Byte-identical to what write_route_sidecar writes for the same documents.
    with temp_paths(finals) as temps:
        _write_rows(temps[0], streams, doc_lengths_D, doc_offsets_D, offset_unit, row_bytes)
        _write_index(temps[1], doc_lengths_D, num_layers * topk, dtype)
        header = header_bytes(
            num_layers=num_layers,
            topk=topk,
            num_experts=num_experts,
            dtype=dtype,
            lengths_D=doc_lengths_D,
            tokens=tokens,
            moe_layer_ids=moe_layer_ids,
        )
        with open(temps[2], "wb") as f:
            f.write(header)
        for tmp in temps:
            fsync_path(tmp)
        publish(zip(temps, finals, strict=True))  # .idx last: loads only with its header
    return int(np.asarray(doc_lengths_D).size)


def _check_streams(streams: Sequence[str], flag: str) -> None:
    """Every rank's stream files are there (a rank's on another filesystem would not be)."""
    for base in streams:
        for path in stream_files(base):
            if not os.path.isfile(path):
                raise ValueError(
                    f"{flag}: the recording stream {path} is missing (every data-parallel rank "
                    "writes one beside the output: the path must be on a filesystem all ranks "
                    "share)"
                )


def _write_rows(
    path: str,
    streams: Sequence[str],
    lengths_D: np.ndarray,
    offsets_D: np.ndarray | None,
    offset_unit: int,
    row_bytes: int,
) -> None:
    """The sidecar's ``.bin``: every token missing, then each stream's pieces at their offsets."""
    if offsets_D is None:
        offsets_D = np.concatenate([[0], np.cumsum(lengths_D, dtype=np.int64)[:-1]])
    num_tokens = int(np.sum(lengths_D, dtype=np.int64))
    _fill(path, num_tokens * row_bytes)
    fd = os.open(path, os.O_WRONLY)
    try:
        # Streams in order, each in recording order: a token recorded twice keeps its last
        # recording, as the former in-memory recorder did.
        for base in streams:
            _replay_stream(fd, base, lengths_D, offsets_D, offset_unit, row_bytes)
    finally:
        os.close(fd)


def _fill(path: str, nbytes: int) -> None:
    """Writes ``nbytes`` of the missing marker, all bits set in uint8 and uint16 (every token
    missing until recorded)."""
    block = b"\xff" * CHUNK_BYTES
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.write(block[: nbytes % len(block)])


def _replay_stream(
    fd: int,
    base: str,
    lengths_D: np.ndarray,
    offsets_D: np.ndarray,
    offset_unit: int,
    row_bytes: int,
) -> None:
    """Writes each piece of stream ``base`` at its document offset, in recording order."""
    pieces_path, rows_path = stream_files(base)
    with open(pieces_path, "rb") as pieces, open(rows_path, "rb") as rows:
        while True:
            raw = pieces.read(PIECES_PER_READ * 24)
            chunk_Q3 = np.frombuffer(raw, dtype=np.int64).reshape(-1, 3)
            if chunk_Q3.shape[0] == 0:
                break
            for doc, start, length in chunk_Q3.tolist():
                if not (0 <= doc < len(lengths_D) and 0 <= start <= start + length
                        <= int(lengths_D[doc])):  # fmt: skip
                    raise ValueError(
                        f"recording stream {base}: piece (document {doc}, start {start}, "
                        f"length {length}) lies outside the documents being recorded"
                    )
                offset = (int(offsets_D[doc]) // offset_unit + start) * row_bytes
                _copy_rows(rows, fd, offset, length * row_bytes, base)


def _copy_rows(rows, fd: int, offset: int, nbytes: int, base: str) -> None:
    """Copies ``nbytes`` from the rows file to ``fd`` at ``offset``, a chunk at a time."""
    while nbytes:
        data = rows.read(min(nbytes, CHUNK_BYTES))
        if not data:
            raise ValueError(f"recording stream {base}: its rows file ends early (truncated)")
        os.pwrite(fd, data, offset)
        offset += len(data)
        nbytes -= len(data)


def _write_index(path: str, lengths_D: np.ndarray, width: int, dtype: np.dtype) -> None:
    """Megatron's ``.idx`` for documents of ``width * lengths_D[d]`` values, one sequence per
    document, written in chunks (what ``IndexedDatasetBuilder.finalize`` writes in one go)."""
    num_docs = int(np.asarray(lengths_D).size)
    per_chunk = max(CHUNK_BYTES // 32, 1)  # int64 values, their products and bytes: ~1 chunk
    with open(path, "wb") as f:
        f.write(_INDEX_HEADER + struct.pack("<Q", 1) + struct.pack("<B", _DTYPE_CODES[dtype]))
        f.write(struct.pack("<Q", num_docs) + struct.pack("<Q", num_docs + 1))
        # Sizes (int32), then byte pointers (int64), then document indices (int64): each streamed
        # in chunks, so a memory-mapped lengths array is never copied whole.
        for lo in range(0, num_docs, per_chunk):
            values = np.asarray(lengths_D[lo : lo + per_chunk], dtype=np.int64) * width
            if values.size and values.max() > _INT32_MAX:
                raise ValueError(
                    f"document {lo + int(values.argmax())} has more route ids than an .idx "
                    "can index (int32)"
                )
            f.write(values.astype(np.int32).tobytes())
        pointer = 0
        for lo in range(0, num_docs, per_chunk):
            values = np.asarray(lengths_D[lo : lo + per_chunk], dtype=np.int64) * width
            ends = np.cumsum(values * dtype.itemsize) + pointer
            f.write((ends - values * dtype.itemsize).tobytes())
            pointer = int(ends[-1])
        for lo in range(0, num_docs + 1, per_chunk):
            f.write(np.arange(lo, min(lo + per_chunk, num_docs + 1), dtype=np.int64).tobytes())
