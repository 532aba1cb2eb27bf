"""Encodes a JSONL file in chunks, in this process or in ``--workers`` processes, in input order.

The file is read in chunks of lines (:func:`read_chunks`); each chunk is encoded on its own
(:func:`~megatron_ext.data.jsonl_documents.encode_chunk`) and the chunks come back in input order,
so the output is the same for any number of workers. At most ``2 * workers`` chunks are in flight:
memory does not grow with the input (``multiprocessing.Pool.imap``, which Megatron-LM's script
uses, reads ahead without bound while the writer is slower than the reader).

A worker that dies (killed, or out of memory) ends the encoding: the chunk it held is lost, so the
``ChildProcessError`` raised names the first chunk not encoded. ``multiprocessing.Pool`` would start
a new worker and wait for the lost chunk forever; ``ProcessPoolExecutor`` marks itself broken. The
workers die with the process that started them (``PR_SET_PDEATHSIG``), even by ``kill -9``::

    for chunk, nbytes in encode_file("in.jsonl", spec, fmt, workers=4):
        ...  # chunk 0, 1, 2, ... in order
"""

import collections
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import BinaryIO

from megatron_ext.common.process_exit import die_with_parent
from megatron_ext.data.jsonl_documents import EncodedChunk, RecordFormat, encode_chunk
from megatron_ext.data.text_tokenizers import TextTokenizer, TokenizerSpec, load_tokenizer

#: A chunk ends after the line that brings it to this many bytes (or :data:`CHUNK_LINES` lines).
CHUNK_BYTES = 1 << 20
CHUNK_LINES = 4096

#: The worker process's tokenizer and record format (set by :func:`_init_worker`).
_WORKER: dict = {}


def read_chunks(f: BinaryIO) -> Iterator[tuple[int, list[bytes]]]:
    """``(number of the chunk's first line, its raw lines)`` of a binary file."""
    lines: list[bytes] = []
    first, size = 1, 0
    for lineno, line in enumerate(f, start=1):
        lines.append(line)
        size += len(line)
        if size >= CHUNK_BYTES or len(lines) >= CHUNK_LINES:
            yield first, lines
            lines, first, size = [], lineno + 1, 0
    if lines:
        yield first, lines


def _init_worker(spec: TokenizerSpec, fmt: RecordFormat) -> None:
    die_with_parent()  # forked by the thread that submits (the caller), which outlives the pool
    _WORKER["tok"], _WORKER["fmt"] = load_tokenizer(spec), fmt


def _encode_in_worker(task: tuple[int, list[bytes]]) -> tuple[EncodedChunk, int]:
    first, lines = task
    return encode_chunk(lines, first, _WORKER["fmt"], _WORKER["tok"]), sum(map(len, lines))


def encode_file(
    path: str,
    spec: TokenizerSpec,
    fmt: RecordFormat,
    workers: int = 1,
    tok: TextTokenizer | None = None,
) -> Iterator[tuple[EncodedChunk, int]]:
    """Yields ``(encoded chunk, its bytes of input)`` in input order.

    Args:
        path: The JSONL file.
        spec: The tokenizer each worker loads.
        fmt: How records are read.
        workers: Processes encoding chunks; 1 encodes in this process (with ``tok`` if given).
        tok: ``spec``'s tokenizer, already loaded here (used when ``workers == 1``).
    """
    with open(path, "rb") as f:
        if workers == 1:
            tok = tok or load_tokenizer(spec)
            for first, lines in read_chunks(f):
                yield encode_chunk(lines, first, fmt, tok), sum(map(len, lines))
            return
        pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(spec, fmt))
        try:
            pending: collections.deque[tuple[int, int, Future]] = collections.deque()
            for first, lines in read_chunks(f):
                task = pool.submit(_encode_in_worker, (first, lines))
                pending.append((first, first + len(lines) - 1, task))
                if len(pending) >= 2 * workers:
                    yield _result(pending.popleft(), path)
            while pending:
                yield _result(pending.popleft(), path)
        finally:  # an error, or the caller stopped early: no chunk is started any more
            pool.shutdown(cancel_futures=True)


def _result(chunk: tuple[int, int, Future], path: str) -> tuple[EncodedChunk, int]:
    """A chunk's encoding; a worker's death raised as ``ChildProcessError`` naming the chunk."""
    first, last, task = chunk
    try:
        return task.result()
    except BrokenProcessPool as err:
        raise ChildProcessError(
            f"{path} lines {first}-{last}: a worker process died before they were encoded "
            "(killed, or out of memory?)"
        ) from err
