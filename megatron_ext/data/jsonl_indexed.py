"""A JSONL file -> IndexedDatasets (one per text key, + a loss-mask sidecar), streamed: the body
of ``tools/preprocess_data.py``, also timed by the ``preprocess`` benchmark. No token data is held
in memory; the outputs are published together at the end::

    documents, tokens = jsonl_to_indexed("in.jsonl", spec, fmt, ["/d/web_text_document"], np.uint16)
"""

from collections.abc import Sequence

import numpy as np
from megatron.core.datasets.indexed_dataset import DType

from megatron_ext.data.encode_workers import encode_file
from megatron_ext.data.indexed_writer import StreamingPrefixes
from megatron_ext.data.jsonl_documents import RecordFormat
from megatron_ext.data.text_tokenizers import TextTokenizer, TokenizerSpec


def token_dtype(vocab_size: int) -> type[np.number]:
    """The dtype Megatron-LM's script stores ids in: uint16 below 65500 ids, else int32."""
    # From the vocabulary, not the ids present: two shards of one tokenizer always share a dtype,
    # which Megatron's merge requires.
    return DType.optimal_dtype(vocab_size)


def jsonl_to_indexed(
    path: str,
    spec: TokenizerSpec,
    fmt: RecordFormat,
    outputs: Sequence[str],
    dtype: type[np.number],
    *,
    mask_prefix: str | None = None,
    remove: Sequence[str] = (),
    workers: int = 1,
    tok: TextTokenizer | None = None,
    progress=None,
) -> tuple[int, list[int]]:
    """Writes ``outputs`` (one per ``fmt.keys``, or one for prompt/response records) and, with
    prompt/response records, ``mask_prefix``; deletes ``remove`` prefixes in the same commit.

    ``progress``: a tqdm-like bar, advanced by the input bytes done.

    Returns:
        ``(records, tokens written per output)``.

    Raises:
        ValueError: No records, an output with no tokens, or ``encode_chunk``'s errors; nothing
            is written then.
    """
    with_mask = fmt.prompt_key is not None
    assert with_mask == (mask_prefix is not None)
    # The mask first: the tokens' .idx is then the commit's last file, and a kill while
    # publishing leaves new tokens that do not load rather than beside the old mask.
    targets = ([(mask_prefix, np.uint8)] if with_mask else []) + [(p, dtype) for p in outputs]
    first = 1 if with_mask else 0
    records, tokens = 0, [0] * len(outputs)
    with StreamingPrefixes(targets, remove=remove) as out:
        for chunk, nbytes in encode_file(path, spec, fmt, workers, tok):
            if with_mask:
                out.add_documents(0, chunk.mask, chunk.seq_lens[0], chunk.doc_seqs[0])
            for o in range(len(outputs)):
                out.add_documents(first + o, chunk.ids[o], chunk.seq_lens[o], chunk.doc_seqs[o])
                tokens[o] += chunk.ids[o].size
            records += chunk.doc_seqs[0].size
            if progress is not None:
                progress.update(nbytes)
        if not records:
            raise ValueError(f"--input {path} holds no records: nothing to write")
        for prefix, count in zip(outputs, tokens, strict=True):
            if not count:  # an empty .bin: Megatron cannot even mmap it
                raise ValueError(
                    f"--input {path} holds only empty documents (0 tokens) for {prefix}"
                )
        out.commit()
    return records, tokens
