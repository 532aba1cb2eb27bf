"""JSONL records -> token documents (+ per-token loss mask), for ``tools/preprocess_data.py``.

Tokenizers run locally: the built-in byte-level one (UTF-8 bytes, ids 0..255, end-of-document
id 256), or a Hugging Face ``tokenizer.json`` file or tokenizer directory (the layout
``save_pretrained`` writes, which Megatron's ``--tokenizer-type HuggingFaceTokenizer
--tokenizer-model DIR`` loads; needs the ``tokenizers`` package; no network).
A record is either ``{"text": ...}`` (every token trained on) or ``{"prompt": ..., "response":
...}`` (prompt tokens get loss mask 0)::

    {"prompt": "Q: 2+2?", "response": " 4"}  -> tokens [81 58 ... 32 52 256]
                                                mask   [ 0  0 ...  1  1   1]
"""

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

BYTE_VOCAB_SIZE = 257
BYTE_EOD_ID = 256

Tokenize = Callable[[str], np.ndarray]


def refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads`` object hook: a key given twice would silently keep only its last value.

    Raises:
        ValueError: Naming the key.
    """
    record = dict(pairs)
    if len(record) != len(pairs):
        keys = [key for key, _ in pairs]
        dup = next(key for i, key in enumerate(keys) if key in keys[:i])
        raise ValueError(f"key {dup!r} appears twice (only one of its values would be kept)")
    return record


def byte_tokenizer(text: str) -> np.ndarray:
    """UTF-8 bytes as ids (int64)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class HFTokenizer:
    """A local Hugging Face tokenizer, as :func:`hf_tokenizer` loads it."""

    tokenize: Tokenize
    """Text -> ids (int64), no special tokens added."""
    vocab_size: int
    """Ids the tokenizer can produce, added tokens included."""
    eos_id: int | None
    """Id of the directory's ``eos_token`` (``tokenizer_config.json``); None for a bare file."""


def hf_tokenizer(path: str, flag: str = "--tokenizer-file") -> HFTokenizer:
    """A tokenizer from a local ``tokenizer.json`` or a Hugging Face tokenizer directory.

    A directory is read as ``DIR/tokenizer.json`` (the vocabulary and merges) and
    ``DIR/tokenizer_config.json`` (its ``eos_token``, the end-of-document token), the files
    ``save_pretrained`` writes and Megatron's ``HuggingFaceTokenizer`` loads.

    Raises:
        ValueError: A missing/unreadable file, an ``eos_token`` outside the vocabulary, or the
            ``tokenizers`` package absent; the message names ``flag`` and the file.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise ValueError(
            f"{flag} {path} needs the 'tokenizers' package (pip install -e .[tools])"
        ) from err
    file, config = path, None
    if os.path.isdir(path):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise ValueError(
                f"{flag} {path} is a directory without tokenizer.json (a Hugging Face tokenizer "
                "directory as save_pretrained writes it; slow-only tokenizers are not supported)"
            )
        config = os.path.join(path, "tokenizer_config.json")
    try:
        tok = Tokenizer.from_file(file)
    except Exception as err:  # the Rust library raises its own exception types
        raise ValueError(f"{flag} {file} is not a readable tokenizer.json: {err}") from err
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos_id = None
    if config is not None and os.path.isfile(config):
        eos_id = _eos_id(tok, config, flag)

    def tokenize(text: str) -> np.ndarray:
        return np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    return HFTokenizer(tokenize=tokenize, vocab_size=vocab_size, eos_id=eos_id)


def _eos_id(tok: Any, config_path: str, flag: str) -> int | None:
    """The id of ``eos_token`` in ``tokenizer_config.json`` (a string or an AddedToken dict)."""
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{flag} {config_path} is not valid JSON ({err})") from err
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is None:
        return None
    eos_id = tok.token_to_id(eos) if isinstance(eos, str) else None
    if eos_id is None:
        raise ValueError(f"{flag} {config_path}: eos_token {eos!r} is not in the vocabulary")
    return int(eos_id)


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
            record = json.loads(line, object_pairs_hook=refuse_duplicate_keys)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source} line {lineno} is not valid JSON: {err}") from err
        except ValueError as err:  # a key twice: one of its texts would be dropped silently
            raise ValueError(f"{source} line {lineno}: {err}") from err
        keys = [prompt_key, response_key] if prompt_key is not None else [text_key]
        for key in keys:
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise ValueError(f"{source} line {lineno} has no string field {key!r}")  # noqa: TRY004
        try:
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
        except UnicodeEncodeError as err:  # a lone surrogate ("\ud800"): JSON allows it, UTF-8 not
            raise ValueError(
                f"{source} line {lineno} holds {err.object[err.start : err.end]!r}, which is not "
                f"text UTF-8 can encode ({err.reason})"
            ) from err
        if eod_id is not None:
            tokens = np.append(tokens, eod_id)
            mask = np.append(mask, 1)
        yield tokens.astype(np.int64), mask.astype(np.uint8)
