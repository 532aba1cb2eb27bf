"""The embedded demo corpus (generated text shipped in the package), byte-level tokenised.

Byte-level ids are the UTF-8 bytes of the text (vocabulary 256); id 0 never occurs in text, which makes it
the natural constant pad id for comparisons.

Example::

    docs = corpus_documents()          # list of int64 arrays, one per document
"""

import functools
import json
from importlib import resources

import numpy as np

VOCAB_SIZE = 256
CONSTANT_PAD_ID = 0


@functools.lru_cache(maxsize=1)
def corpus_documents() -> tuple[np.ndarray, ...]:
    """Every document of ``megatron_ext/assets/corpus.jsonl`` as byte ids (int64)."""
    text = resources.files("megatron_ext").joinpath("assets/corpus.jsonl").read_text("utf-8")
    docs = []
    for line in text.splitlines():
        data = json.loads(line)["text"].encode("utf-8")
        docs.append(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
    return tuple(docs)


def corpus_stream(offset: int, length: int) -> np.ndarray:
    """``length`` consecutive byte ids of the concatenated corpus starting at ``offset`` (wrapping)."""
    stream = np.concatenate(corpus_documents())
    index = (offset + np.arange(length)) % stream.size
    return stream[index]
