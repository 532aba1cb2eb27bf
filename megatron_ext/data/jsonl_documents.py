"""JSONL records -> token documents (+ per-token loss mask), for ``tools/preprocess_data.py``.

Tokenizers run locally: the built-in byte-level one (UTF-8 bytes, ids 0..255, end-of-document
id 256) or a Hugging Face ``tokenizer.json`` file (needs the ``tokenizers`` package; no network).
A record is either ``{"text": ...}`` (every token trained on) or ``{"prompt": ..., "response":
...}`` (prompt tokens get loss mask 0)::

    {"prompt": "Q: 2+2?", "response": " 4"}  -> tokens [81 58 ... 32 52 256]
                                                mask   [ 0  0 ...  1  1   1]
"""

import json
from collections.abc import Callable, Iterator

import numpy as np

BYTE_VOCAB_SIZE = 257
BYTE_EOD_ID = 256

Tokenize = Callable[[str], np.ndarray]


def byte_tokenizer(text: str) -> np.ndarray:
    """UTF-8 bytes as ids (int64)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def hf_tokenizer(path: str) -> Tokenize:
    """A tokenizer from a local Hugging Face ``tokenizer.json`` (no special tokens added).

    Raises:
        ValueError: The file is missing/unreadable or the ``tokenizers`` package is absent.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise ValueError(
            f"--tokenizer-file {path} needs the 'tokenizers' package (pip install tokenizers)"
        ) from err
    try:
        tok = Tokenizer.from_file(path)
    except Exception as err:  # the Rust library raises its own exception types
        raise ValueError(
            f"--tokenizer-file {path} is not a readable tokenizer.json: {err}"
        ) from err
    return lambda text: np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)


def read_documents(
    lines: Iterator[str],
    tokenize: Tokenize,
    *,
    text_key: str = "text",
    prompt_key: str | None = None,
    response_key: str | None = None,
    eod_id: int | None = None,
    source: str = "<input>",
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yields ``(tokens_N, loss_mask_N)`` per JSONL line (blank lines skipped).

    Raises:
        ValueError: A line is not JSON or lacks a key; the message names file, line and key.
    """
    if (prompt_key is None) != (response_key is None):
        raise ValueError("--prompt-key and --response-key must be given together")
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source} line {lineno} is not valid JSON: {err}") from err
        keys = [prompt_key, response_key] if prompt_key is not None else [text_key]
        for key in keys:
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise ValueError(f"{source} line {lineno} has no string field {key!r}")  # noqa: TRY004
        if prompt_key is not None:
            prompt, response = (
                tokenize(record[prompt_key]),
                tokenize(record[response_key]),
            )
            tokens = np.concatenate([prompt, response])
            mask = np.concatenate([np.zeros(prompt.size), np.ones(response.size)])
        else:
            tokens = tokenize(record[text_key])
            mask = np.ones(tokens.size)
        if eod_id is not None:
            tokens = np.append(tokens, eod_id)
            mask = np.append(mask, 1)
        yield tokens.astype(np.int64), mask.astype(np.uint8)
