"""JSONL records -> token documents (+ per-token loss mask), for ``tools/preprocess_data.py``.

A record becomes one document per output as Megatron-LM's ``tools/preprocess_data.py`` makes it
(its ``Encoder.encode``); a prompt/response record (this project's) is one sequence whose prompt
tokens get loss mask 0::

    {"text": ["Hi.", "", "Yo."]}  -> document of 2 sequences: [72 105 46] [89 111 46 256]
    {"text": ""}                  -> document of 0 sequences (no [eod])
    {"prompt": "Q: 2+2?", "response": " 4"}  -> tokens [81 58 ... 32 52 256]
                                                mask   [ 0  0 ...  1  1   1]
"""

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_ext.common.jsonl_lines import decode_line, refuse_duplicate_keys
from megatron_ext.data.text_tokenizers import (
    BYTE_EOD_ID,  # noqa: F401  (re-exported for the tools)
    TextTokenizer,
    byte_encode,
)

byte_tokenizer = byte_encode  # the built-in byte-level tokenizer, one text at a time


@dataclasses.dataclass(frozen=True)
class RecordFormat:
    """How records are read: text keys (one output each), or a prompt/response pair."""

    keys: tuple[str, ...] = ("text",)
    """Keys whose text (a string or a list of sentences) is tokenized, one output per key."""
    prompt_key: str | None = None
    """With ``response_key``: one output, prompt tokens loss-masked (``keys`` unused)."""
    response_key: str | None = None
    eod_id: int | None = None
    """Appended to every non-empty document."""
    dtype: str = "int32"
    """Stored dtype of the ids."""
    source: str = "<input>"
    """The input's name in errors."""
    tokenizer: str = "the tokenizer"
    """The tokenizer's flag and file in errors."""


@dataclasses.dataclass
class EncodedChunk:
    """A chunk's documents, flat, per output: concatenated ids, sequence lengths, sequences per
    document (0 for an empty one); ``mask`` aligned with ``ids[0]`` for prompt/response records."""

    ids: list[np.ndarray]
    seq_lens: list[np.ndarray]
    doc_seqs: list[np.ndarray]
    mask: np.ndarray | None


def _texts(record: Any, fmt: RecordFormat, where: str) -> list[list[str]]:
    """Per output, the texts to tokenize (sentences, or [prompt, response])."""
    if fmt.prompt_key is not None:  # one output: the prompt then the response, one sequence
        for key in (fmt.prompt_key, fmt.response_key):
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise ValueError(f"{where} has no string field {key!r}")  # noqa: TRY004
        return [[record[fmt.prompt_key], record[fmt.response_key]]]
    out = []
    for key in fmt.keys:
        value = record.get(key) if isinstance(record, dict) else None
        if isinstance(value, str):
            out.append([value])
        elif isinstance(value, list) and all(isinstance(s, str) for s in value):
            out.append(value)
        else:
            raise ValueError(f"{where} has no string field {key!r} (nor a list of strings)")
    return out


def _encode(tok: TextTokenizer, texts: list[str], special: bool) -> list[np.ndarray]:
    return tok.encode_batch(texts, special) if texts else []


def _encode_checked(
    tok: TextTokenizer, texts: list[str], special: bool, where: list[str], fmt: RecordFormat
) -> list[np.ndarray]:
    """Encodes a batch; on failure names the record's line (retried one text at a time)."""
    # One batch call per chunk (fast); only a failed batch is retried text by text, to name the
    # line at fault.
    try:
        return _encode(tok, texts, special)
    except Exception:  # the Rust library raises a bare Exception (e.g. a missing [UNK] token)
        for text, line in zip(texts, where, strict=True):
            try:
                tok.encode_batch([text], special)
            except UnicodeEncodeError as err:  # a lone surrogate: JSON allows it, UTF-8 not
                raise ValueError(
                    f"{line} holds {err.object[err.start : err.end]!r}, which is not text "
                    f"UTF-8 can encode ({err.reason})"
                ) from err
            except Exception as err:  # as above
                raise ValueError(
                    f"{fmt.tokenizer} cannot tokenize {line}: {' '.join(str(err).split())}"
                ) from err
        raise


def encode_chunk(
    lines: Sequence[bytes], first_lineno: int, fmt: RecordFormat, tok: TextTokenizer
) -> EncodedChunk:
    """Encodes raw JSONL lines (blank lines skipped) numbered from ``first_lineno``, with one
    tokenizer call; the documents come back flat, the form ``--workers`` processes send back.

    Raises:
        ValueError: A line that is not UTF-8 or JSON, lacks a key, or cannot be tokenized; the
            message names the file and line.
    """
    records: list[tuple[str, list[list[str]]]] = []
    for lineno, raw in enumerate(lines, start=first_lineno):
        where = f"{fmt.source} line {lineno}"
        line = decode_line(raw, where)
        if line is None:
            continue
        try:
            record = json.loads(line, object_pairs_hook=refuse_duplicate_keys)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where} is not valid JSON: {err}") from err
        except ValueError as err:  # a key twice: one of its texts would be dropped silently
            raise ValueError(f"{where}: {err}") from err
        records.append((where, _texts(record, fmt, where)))
    if fmt.prompt_key is not None:
        return _prompt_response(records, fmt, tok)
    n_out = len(fmt.keys)
    flat = [(where, text) for where, per in records for texts in per for text in texts]
    encoded = iter(_encode_checked(tok, [t for _, t in flat], True, [w for w, _ in flat], fmt))
    ids: list[list[np.ndarray]] = [[] for _ in range(n_out)]
    lens: list[list[int]] = [[] for _ in range(n_out)]
    seqs: list[list[int]] = [[] for _ in range(n_out)]
    for _where, per in records:
        for o, texts in enumerate(per):
            # As Megatron's Encoder: each sentence a sequence, one with no ids dropped, the eod
            # after the last kept one only.
            kept = [s for s in (next(encoded) for _ in texts) if s.size]
            if kept and fmt.eod_id is not None:
                kept[-1] = np.append(kept[-1], fmt.eod_id)
            ids[o] += kept
            lens[o] += [s.size for s in kept]
            seqs[o].append(len(kept))
    return EncodedChunk(
        ids=[_concat(i, fmt.dtype) for i in ids],
        seq_lens=[np.asarray(x, dtype=np.int64) for x in lens],
        doc_seqs=[np.asarray(x, dtype=np.int64) for x in seqs],
        mask=None,
    )


def _prompt_response(
    records: list[tuple[str, list[list[str]]]], fmt: RecordFormat, tok: TextTokenizer
) -> EncodedChunk:
    wheres = [where for where, _ in records]
    # Special tokens (a BOS) before the prompt only: the response continues the same sequence.
    prompts = _encode_checked(tok, [per[0][0] for _, per in records], True, wheres, fmt)
    responses = _encode_checked(tok, [per[0][1] for _, per in records], False, wheres, fmt)
    ids, masks, lens, seqs = [], [], [], []
    for prompt, response in zip(prompts, responses, strict=True):
        tokens = np.concatenate([prompt, response])
        mask = np.concatenate([np.zeros(prompt.size), np.ones(response.size)])
        if tokens.size and fmt.eod_id is not None:  # the prompt's BOS, if any, is mask 0
            tokens, mask = np.append(tokens, fmt.eod_id), np.append(mask, 1)
        if tokens.size:
            ids.append(tokens)
            masks.append(mask)
            lens.append(tokens.size)
        seqs.append(1 if tokens.size else 0)
    return EncodedChunk(
        ids=[_concat(ids, fmt.dtype)],
        seq_lens=[np.asarray(lens, dtype=np.int64)],
        doc_seqs=[np.asarray(seqs, dtype=np.int64)],
        mask=_concat(masks, "uint8"),
    )


def _concat(arrays: list[np.ndarray], dtype: str) -> np.ndarray:
    if not arrays:
        return np.zeros(0, dtype=dtype)
    flat = np.concatenate(arrays)
    # Checked before the cast: numpy would wrap an id silently.
    if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(dtype).max):
        raise ValueError(f"token id {int(flat.max())} does not fit the stored dtype {dtype}")
    return flat.astype(dtype)
