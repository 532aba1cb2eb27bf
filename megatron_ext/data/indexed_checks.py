"""Checks of Megatron IndexedDatasets and dataset configs before any sample is read (glue).

Megatron maps ``.bin`` files lazily and trusts caches by a description of the flags, so several
wrong inputs would otherwise open fine and fail (or read garbage) at some later sample:

- :func:`open_indexed`: the ``.bin`` must be exactly the size its ``.idx`` indexes (a killed
  writer, a truncated copy);
- :func:`check_aligned`: a sidecar has the token dataset's documents, ``width`` values per token;
- :func:`check_values`: every value of a sidecar lies in an allowed set (e.g. a loss mask is 0/1),
  scanned vectorized in chunks once and remembered by the file's identity;
- :func:`add_data_identity`: a dataset's cache description (Megatron's ``unique_identifiers``)
  includes the data's identity, so index caches are never reused for rewritten data;
- :func:`check_dataset_config`: blend weights and sizes Megatron would accept silently.
"""

import hashlib
import json
import math
import os
import struct
from typing import Any

import numpy as np
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.common.safe_files import file_identity, lengths_fingerprint
from megatron_ext.data import pack_index_cache
from megatron_ext.data.data_args import empty_bin_reason

#: Values per chunk of a whole-file scan (bounded memory for any file size).
CHUNK_VALUES = 1 << 24


def check_blend_weights(flag: str, prefixes: list[str], weights: list[float]) -> None:
    """Refuses a blend weight Megatron's ``BlendedDataset`` asserts on (after building every
    index), naming ``flag`` and the prefix."""
    for weight, prefix in zip(weights, prefixes, strict=True):
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(
                f"{flag} weight {weight} for {prefix} must be finite and > 0 (Megatron's "
                "BlendedDataset asserts it after building every index; leave the prefix out to "
                "switch it off)"
            )


def check_dataset_config(config: GPTDatasetConfig) -> None:
    """ValueErrors for inputs Megatron would accept silently or fail on obscurely."""
    if config.sequence_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {config.sequence_length}")
    blends = [config.blend] + list(config.blend_per_split or [])
    for blend in (b for b in blends if b is not None):
        prefixes, weights = blend
        if weights is None:
            continue
        check_blend_weights("--data-path", prefixes, weights)
    pad_id = getattr(config, "pad_constant_id", 0)
    if pad_id < 0:
        raise ValueError(f"--pad-constant-id must be >= 0, got {pad_id}")
    try:
        vocab = config.tokenizer.vocab_size
    except (AttributeError, NotImplementedError):
        vocab = None
    if isinstance(vocab, int) and pad_id >= vocab:
        raise ValueError(
            f"--pad-constant-id {pad_id} is outside the tokenizer's vocabulary (size {vocab})"
        )


def open_indexed(path_prefix: str, what: str) -> IndexedDataset:
    """Opens ``path_prefix``.idx/.bin, checking the .bin holds exactly what the .idx indexes.

    Raises:
        ValueError: A missing, corrupt, truncated or over-long file; the message names it.
    """
    idx_path, bin_path = path_prefix + ".idx", path_prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise ValueError(f"{what} file {path} does not exist")
    if os.path.getsize(bin_path) == 0:  # before Megatron's reader, whose half-built one complains
        raise ValueError(empty_bin_reason(bin_path, what))
    try:
        dataset = IndexedDataset(path_prefix, multimodal=False, mmap=True)
    except (AssertionError, ValueError, struct.error, KeyError) as err:
        raise ValueError(f"{what} {path_prefix}.idx/.bin is corrupt: {err}") from err
    index = dataset.index
    expected = 0
    if index.sequence_lengths.size:
        last_end = index.sequence_pointers[-1] + index.sequence_lengths[-1] * index.dtype_size
        expected = int(last_end)
    actual = os.path.getsize(bin_path)
    if actual != expected:
        raise ValueError(
            f"{what} file {bin_path} has {actual} bytes but {idx_path} indexes {expected} "
            f"({index.sequence_lengths.size} sequences of {np.dtype(index.dtype).name}): "
            f"{_size_diagnosis(actual, expected, index.dtype_size)}; rewrite it"
        )
    return dataset


def _size_diagnosis(actual: int, expected: int, itemsize: int) -> str:
    """Why a ``.bin`` is not the size its ``.idx`` indexes: truncated or corrupt, and where its
    size holds exactly the indexed tokens at another width, possibly written with another dtype
    than the ``.idx`` records (uint16 tokens beside an int32 index). The size alone cannot tell
    a copy cut at exactly that length from such a pair, so both are named."""
    tokens = expected // itemsize
    for width in (1, 2, 4, 8):
        if width != itemsize and tokens and tokens * width == actual:
            return (
                f"the file is truncated, or the .bin and .idx were written with different dtypes "
                f"(it holds exactly those {tokens} tokens as {width}-byte values; the .idx says "
                f"{itemsize}-byte)"
            )
    return "the file is truncated or corrupt"


def check_aligned(tokens: IndexedDataset, side: IndexedDataset, width: int, path: str) -> None:
    """Refuses a sidecar whose documents do not hold ``width`` values per token."""
    lens, side_lens = tokens.sequence_lengths, side.sequence_lengths
    if side_lens.shape != lens.shape:
        raise ValueError(
            f"sidecar {path} has {side_lens.size} documents, the tokens have {lens.size}"
        )
    bad = np.flatnonzero(side_lens != width * lens)
    if bad.size:
        d = int(bad[0])
        raise ValueError(
            f"sidecar {path} document {d} has {int(side_lens[d])} values, expected "
            f"{width} x {int(lens[d])} tokens"
        )


def flat_values(dataset: IndexedDataset, path_prefix: str) -> np.ndarray:
    """The whole ``.bin`` as one read-only memory-mapped array (documents are contiguous)."""
    index = dataset.index
    if index.sequence_lengths.size == 0:
        return np.zeros(0, dtype=index.dtype)
    return np.memmap(path_prefix + ".bin", dtype=index.dtype, mode="r")


def check_values(
    dataset: IndexedDataset,
    path_prefix: str,
    allowed: tuple[int, ...],
    what: str,
    cache_dir: str | None,
) -> None:
    """Refuses a sidecar holding a value outside ``allowed``; names document and token.

    Scans the file once in chunks of :data:`CHUNK_VALUES`; a pass is remembered in ``cache_dir``
    under the file's identity, so an unchanged file is not read again.
    """
    key = f"values {allowed} {os.path.realpath(path_prefix)} {file_identity(path_prefix + '.bin')}"
    if pack_index_cache.validated(cache_dir, key):
        return
    flat = flat_values(dataset, path_prefix)
    allowed_arr = np.asarray(allowed)
    for start in range(0, flat.size, CHUNK_VALUES):
        bad = np.flatnonzero(~np.isin(flat[start : start + CHUNK_VALUES], allowed_arr))
        if bad.size:
            doc, token = locate(dataset.sequence_lengths, start + int(bad[0]))
            value = flat[start + int(bad[0])].item()
            raise ValueError(
                f"{what} {path_prefix}: document {doc}, token {token} holds {value!r}; only "
                f"{list(allowed)} are allowed"
            )
    pack_index_cache.mark_validated(cache_dir, key)


def locate(lengths_D: np.ndarray, flat_index: int, width: int = 1) -> tuple[int, int]:
    """``(document, token)`` of value ``flat_index`` of a file whose document d holds
    ``width * lengths_D[d]`` values."""
    ends = np.cumsum(np.asarray(lengths_D, dtype=np.int64) * width)
    doc = int(np.searchsorted(ends, flat_index, side="right"))
    start = int(ends[doc - 1]) if doc else 0
    return doc, (flat_index - start) // width


def add_data_identity(dataset: Any, fingerprint: str) -> None:
    """Adds ``fingerprint`` to a MegatronDataset's ``unique_identifiers`` and recomputes its
    description and hash, so its index caches (and a blend's) are keyed by the data too."""
    dataset.unique_identifiers["data_identity"] = fingerprint
    dataset.unique_description = json.dumps(
        dataset.unique_identifiers, indent=4, default=lambda obj: obj.unique_identifiers
    )
    dataset.unique_description_hash = hashlib.md5(
        dataset.unique_description.encode("utf-8"), usedforsecurity=False
    ).hexdigest()


def data_identity(dataset: IndexedDataset) -> str:
    """Identity of the token data an index depends on (see ``lengths_fingerprint``)."""
    return lengths_fingerprint(dataset.sequence_lengths)


def default_cache_dir(config: GPTDatasetConfig, path_prefix: str) -> str:
    """``path_to_cache`` (``--data-cache-path``), else ``<data dir>/cache/PackedDataset_indices``."""
    return cache_dir_for(config.path_to_cache, path_prefix)


def cache_dir_for(path_to_cache: str | None, path_prefix: str) -> str:
    """``path_to_cache`` when given, else ``<data dir>/cache/PackedDataset_indices``."""
    if path_to_cache is not None:
        return path_to_cache
    return os.path.join(os.path.dirname(path_prefix), "cache", "PackedDataset_indices")
