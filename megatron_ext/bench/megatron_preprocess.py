"""Megatron-LM's ``tools/preprocess_data.py``, driven with Megatron-Core's installed classes: the
reference the ``preprocess`` benchmark times and the parity tests compare bytes with.

The script is not in the megatron-core wheel; this follows it as read at NVIDIA/Megatron-LM commit
00736f4c796c3b9b4bc0609320064a0afdcd8edc::

    megatron_preprocess("in.jsonl", "/d/web", ["--tokenizer-type", "HuggingFaceTokenizer",
                        "--tokenizer-model", DIR], keys=["text"], append_eod=True, workers=2)
    # -> /d/web_text_document.bin/.idx
"""

import argparse
import json
import multiprocessing
from typing import Any

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder


def megatron_tokenizer(tokenizer_argv: list[str]) -> Any:
    """``build_tokenizer`` with the arguments Megatron-LM's script parses and sets."""
    # The script's get_args: _add_tokenizer_args, then the dummy rank,
    # make_vocab_size_divisible_by, tensor_model_parallel_size and vocab_extra_ids.
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.arguments import _add_tokenizer_args

    args = _add_tokenizer_args(argparse.ArgumentParser()).parse_args(tokenizer_argv)
    args.rank, args.make_vocab_size_divisible_by = 1, 128
    args.tensor_model_parallel_size, args.vocab_extra_ids = 1, 0
    return build_tokenizer(args)


class _Encoder:
    """The script's ``Encoder``: its tokenizer is a class attribute set in each worker."""

    tokenizer: Any = None

    def __init__(self, tokenizer_argv: list[str], keys: list[str], append_eod: bool) -> None:
        self.tokenizer_argv, self.keys, self.append_eod = tokenizer_argv, keys, append_eod

    def initializer(self) -> None:
        _Encoder.tokenizer = megatron_tokenizer(self.tokenizer_argv)

    def encode(self, json_line: str) -> tuple[dict, dict, int]:
        # A text or a list of sentences; a sentence with no ids dropped; eod after a non-empty
        # document.
        data = json.loads(json_line)
        ids, lens = {}, {}
        for key in self.keys:
            text = data[key]
            sentences = text if isinstance(text, list) else [text]
            doc_ids, sentence_lens = [], []
            for sentence in sentences:
                sentence_ids = _Encoder.tokenizer.tokenize(sentence)
                if len(sentence_ids) > 0:
                    doc_ids.extend(sentence_ids)
                    sentence_lens.append(len(sentence_ids))
            if len(doc_ids) > 0 and self.append_eod:
                doc_ids.append(_Encoder.tokenizer.eod)
                sentence_lens[-1] += 1
            ids[key], lens[key] = doc_ids, sentence_lens
        return ids, lens, len(json_line)


def megatron_preprocess(
    jsonl: str,
    prefix: str,
    tokenizer_argv: list[str],
    keys: list[str],
    append_eod: bool,
    workers: int = 1,
) -> int:
    """Runs the script's pipeline; returns the number of tokens written."""
    # Partition.process_json_file: an IndexedDatasetBuilder per key, add_document per record, fed
    # by a Pool(workers) through imap(encode, fin, 32).
    encoder = _Encoder(tokenizer_argv, keys, append_eod)
    tokenizer = megatron_tokenizer(tokenizer_argv)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = {k: IndexedDatasetBuilder(f"{prefix}_{k}_document.bin", dtype=dtype) for k in keys}
    tokens = 0
    with (
        open(jsonl, encoding="utf-8") as fin,
        multiprocessing.Pool(workers, initializer=encoder.initializer) as pool,
    ):
        for doc, sentence_lens, _nbytes in pool.imap(encoder.encode, fin, 32):
            for key in doc:
                builders[key].add_document(doc[key], sentence_lens[key])
                tokens += len(doc[key])
    # That commit finalizes only the last key's builder (the other keys get no .idx); this
    # finalizes each, as its loop intends.
    for key in keys:
        builders[key].finalize(f"{prefix}_{key}_document.idx")
    return tokens
