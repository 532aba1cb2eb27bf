"""The embedded demo corpus (generated text shipped in the package), byte-level tokenised.

Example::

    docs = corpus_documents()          # list of int64 arrays, one per document
"""

import functools
import json
from importlib import resources

import numpy as np

from megatron_ext.data.jsonl_documents import byte_tokenizer

# The byte-level tokenizer of tools/preprocess_data.py: UTF-8 bytes, ids 0..255; its
# end-of-document id 256 is not used here, so the models need only 256 ids.
VOCAB_SIZE = 256
# Id 0 never occurs in text: the natural constant pad id for comparisons.
CONSTANT_PAD_ID = 0


@functools.lru_cache(maxsize=1)
def corpus_documents() -> tuple[np.ndarray, ...]:
    """Every document of ``megatron_ext/assets/corpus.jsonl`` as byte ids (int64)."""
    text = resources.files("megatron_ext").joinpath("assets/corpus.jsonl").read_text("utf-8")
    return tuple(byte_tokenizer(json.loads(line)["text"]) for line in text.splitlines())


def corpus_stream(offset: int, length: int) -> np.ndarray:
    """``length`` consecutive byte ids of the concatenated corpus starting at ``offset`` (wrapping)."""
    stream = np.concatenate(corpus_documents())
    index = (offset + np.arange(length)) % stream.size
    return stream[index]
