"""Encodes a JSONL file in chunks, in this process or in ``--workers`` processes, in input order.

The output is the same for any number of workers; memory does not grow with the input; a worker
that dies ends the encoding with a ``ChildProcessError`` naming the lines lost::

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
        # About 1 MiB a chunk: one tokenizer call, and memory bounded whatever the input.
        if size >= CHUNK_BYTES or len(lines) >= CHUNK_LINES:
            yield first, lines
            lines, first, size = [], lineno + 1, 0
    if lines:
        yield first, lines


def _init_worker(spec: TokenizerSpec, fmt: RecordFormat) -> None:
    # PR_SET_PDEATHSIG: workers die with the tool, by kill -9 too. Forked by the thread that
    # submits (the caller), which outlives the pool.
    die_with_parent()
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

    ``workers`` 1 encodes in this process, with ``tok`` (``spec``'s tokenizer) if already loaded.
    """
    with open(path, "rb") as f:
        if workers == 1:
            tok = tok or load_tokenizer(spec)
            for first, lines in read_chunks(f):
                yield encode_chunk(lines, first, fmt, tok), sum(map(len, lines))
            return
        # Not multiprocessing.Pool (Megatron-LM's script): a dead worker's chunk is lost and Pool
        # starts a new worker and waits for that chunk forever; ProcessPoolExecutor marks itself
        # broken. Pool.imap also reads ahead without bound while the writer is slower.
        pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(spec, fmt))
        try:
            pending: collections.deque[tuple[int, int, Future]] = collections.deque()
            for first, lines in read_chunks(f):
                task = pool.submit(_encode_in_worker, (first, lines))
                pending.append((first, first + len(lines) - 1, task))
                if len(pending) >= 2 * workers:  # bounded in flight: bounded memory
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
