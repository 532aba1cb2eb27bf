"""Checks of Megatron IndexedDatasets and dataset configs before any sample is read (glue).

Megatron maps ``.bin`` files lazily and trusts caches by a description of the flags, so a truncated
``.bin``, another corpus's ``.idx``, a misaligned sidecar, a loss mask holding 2 or rewritten data
at the same prefix would open fine and fail (or read garbage) at some later sample.
"""

import hashlib
import json
import math
import os
import struct
import traceback
from typing import Any

import numpy as np
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.common.safe_files import file_identity, lengths_fingerprint
from megatron_ext.data import pack_index_cache

#: Values per chunk of a whole-file scan (bounded memory for any file size).
CHUNK_VALUES = 1 << 24

#: Bytes of an ``.idx`` before its arrays (Megatron's ``_IndexReader``): magic 9, version 8,
#: dtype code 1, sequence count 8, document count 8.
_INDEX_HEADER_BYTES = 34

#: Sequences per chunk of an index check (a few int64 temporaries each: ~100 MB at most).
_INDEX_CHUNK = 1 << 22


def empty_bin_reason(bin_path: str, what: str) -> str:
    """Why an empty ``.bin`` is refused (Megatron's ``IndexedDataset`` cannot map an empty file,
    and its documents would hold no token to train on)."""
    return (
        f"{what} file {bin_path} is empty: its documents hold no token (Megatron cannot open an "
        "empty .bin); leave the prefix out or rewrite it"
    )


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
    """Opens ``path_prefix``.idx/.bin, refusing (ValueError naming the file) a missing or corrupt
    file or an .idx that does not describe the .bin (:func:`check_index`)."""
    idx_path, bin_path = _existing_pair(path_prefix, what)
    if os.path.getsize(bin_path) == 0:  # before Megatron's reader, whose half-built one complains
        raise ValueError(empty_bin_reason(bin_path, what))
    dataset = _read(path_prefix, what, mmap=True)
    check_index(dataset.index, idx_path, bin_path, what)
    return dataset


def check_shard(path_prefix: str, what: str) -> type[np.number]:
    """A shard's dtype, checked as :func:`open_indexed` does but taking an empty ``.bin``."""
    # Megatron's IndexedDatasetBuilder.add_index reads only the .idx and copies the .bin, so its
    # merge takes an empty shard (only an empty *first* one fails, in the reader that maps the
    # .bin for the dtype).
    idx_path, bin_path = _existing_pair(path_prefix, what)
    dataset = _read(path_prefix, what, mmap=False)  # Megatron's file reader: opens no .bin
    check_index(dataset.index, idx_path, bin_path, what)
    return dataset.index.dtype


def _existing_pair(path_prefix: str, what: str) -> tuple[str, str]:
    idx_path, bin_path = path_prefix + ".idx", path_prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise ValueError(f"{what} file {path} does not exist")
    return idx_path, bin_path


def _read(path_prefix: str, what: str, mmap: bool) -> IndexedDataset:
    try:
        return IndexedDataset(path_prefix, multimodal=False, mmap=mmap)
    except (AssertionError, ValueError, struct.error, KeyError) as err:
        cause = (
            str(err)
            or f"Megatron's reader failed {traceback.extract_tb(err.__traceback__)[-1].line}"
        )
        raise ValueError(f"{what} {path_prefix}.idx/.bin is corrupt: {cause}") from err


def check_index(index: Any, idx_path: str, bin_path: str, what: str) -> None:
    """Refuses (ValueError naming the file) an ``.idx`` (Megatron's ``_IndexReader``) that does
    not describe ``bin_path``: one vectorized pass over the index, never the ``.bin``."""
    # Megatron's reader trusts the .idx (counts from its header, the .bin mapped by its pointers),
    # so another .bin's .idx reads other documents or past the end at some later sample. The
    # format has no checksum: one that cuts the same number of tokens in other places cannot be
    # told from the right one by the files alone (docs/limits.md).
    lens, ptrs, docs = index.sequence_lengths, index.sequence_pointers, index.document_indices
    # The .idx is exactly the header and the arrays its counts give (0.2 s for 20 M sequences):
    # a length and a pointer per sequence, then the document indices.
    count, itemsize = int(lens.size), int(index.dtype_size)
    header = _INDEX_HEADER_BYTES + count * (lens.itemsize + ptrs.itemsize)
    idx_size, idx_expected = os.path.getsize(idx_path), header + docs.size * docs.itemsize
    if idx_size not in (idx_expected, idx_expected + count):  # + a multimodal one's int8 modes
        raise ValueError(
            f"{what} file {idx_path} has {idx_size} bytes but its header counts {count} sequences "
            f"and {docs.size} document indices ({idx_expected} bytes): it is corrupt; rewrite "
            "the .bin/.idx pair"
        )
    not_its_bin = f"{what} file {idx_path} does not describe {bin_path}"
    # Lengths >= 0, each pointer where the lengths before it end, document indices from 0 to the
    # sequence count never going down, and the .bin exactly the bytes the lengths add up to.
    _check_document_indices(docs, count, not_its_bin)
    total = _check_lengths_and_pointers(lens, ptrs, itemsize, not_its_bin)
    actual = os.path.getsize(bin_path)
    if actual != total:
        raise ValueError(
            f"{what} file {bin_path} has {actual} bytes but {idx_path} indexes {total} "
            f"({count} sequences of {np.dtype(index.dtype).name}): "
            f"{_size_diagnosis(actual, total, itemsize)}; rewrite the .bin/.idx pair"
        )


def _check_document_indices(docs: np.ndarray, count: int, not_its_bin: str) -> None:
    """Document indices run from 0 to the sequence count, never down (chunked)."""
    if docs.size == 0 or docs[0] != 0 or docs[-1] != count:
        first, last = (int(docs[0]), int(docs[-1])) if docs.size else (None, None)
        raise ValueError(
            f"{not_its_bin}: its document indices run from {first} to {last}, not from 0 to its "
            f"{count} sequences; it is corrupt, rewrite the .bin/.idx pair"
        )
    for start in range(0, docs.size - 1, _INDEX_CHUNK):
        chunk = np.asarray(docs[start : start + _INDEX_CHUNK + 1])
        down = np.flatnonzero(np.diff(chunk) < 0)
        if down.size:
            d = start + int(down[0])
            raise ValueError(
                f"{not_its_bin}: its document index {d + 1} ({int(docs[d + 1])}) is below index "
                f"{d} ({int(docs[d])}); it is corrupt, rewrite the .bin/.idx pair"
            )


def _check_lengths_and_pointers(
    lens: np.ndarray, ptrs: np.ndarray, itemsize: int, not_its_bin: str
) -> int:
    """Lengths >= 0 and each pointer where the lengths before it end (chunked); returns the
    bytes the lengths add up to."""
    count = int(lens.size)
    total = 0  # bytes of the sequences before the chunk
    for start in range(0, count, _INDEX_CHUNK):
        bytes_S = np.asarray(lens[start : start + _INDEX_CHUNK], dtype=np.int64) * itemsize
        negative = np.flatnonzero(bytes_S < 0)
        if negative.size:
            s = start + int(negative[0])
            raise ValueError(
                f"{not_its_bin}: its sequence {s} has length {int(lens[s])}; it is corrupt, "
                "rewrite the .bin/.idx pair"
            )
        ends_S = total + np.cumsum(bytes_S)
        moved = np.flatnonzero(ptrs[start : start + _INDEX_CHUNK] != ends_S - bytes_S)
        if moved.size:
            s = start + int(moved[0])
            raise ValueError(
                f"{not_its_bin}: its sequence {s} starts at byte {int(ptrs[s])} but the lengths "
                f"before it end at byte {int(ends_S[s - start] - bytes_S[s - start])} (corrupt, or "
                "lengths and pointers of two indexes); rewrite the .bin/.idx pair"
            )
        total = int(ends_S[-1])
    return total


def _size_diagnosis(actual: int, expected: int, itemsize: int) -> str:
    """Why a ``.bin`` is not the size its ``.idx`` indexes: truncated or corrupt, or (its size
    holding exactly the indexed tokens at another width) written with another dtype."""
    # The size alone cannot tell a copy cut at exactly that length from such a pair: name both.
    tokens = expected // itemsize
    for width in (1, 2, 4, 8):
        if width != itemsize and tokens and tokens * width == actual:
            return (
                f"the file is truncated, or the .bin and .idx were written with different dtypes "
                f"(it holds exactly those {tokens} tokens as {width}-byte values; the .idx says "
                f"{itemsize}-byte)"
            )
    return (
        "the .bin is truncated or corrupt, or the .idx is another .bin's (another corpus or shard: "
        "an .idx describes only the .bin written with it)"
    )


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

    A pass is remembered in ``cache_dir``: an unchanged file is not read again.
    """
    # Keyed by the file's identity (inode, size, times): a rewritten file is scanned again.
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


def check_finite(
    dataset: IndexedDataset, path_prefix: str, what: str, cache_dir: str | None
) -> None:
    """Refuses a float sidecar holding a NaN or an infinity; names document and token (a pass
    remembered as :func:`check_values` remembers it)."""
    key = f"finite {os.path.realpath(path_prefix)} {file_identity(path_prefix + '.bin')}"
    if pack_index_cache.validated(cache_dir, key):
        return
    flat = flat_values(dataset, path_prefix)
    for start in range(0, flat.size, CHUNK_VALUES):
        bad = np.flatnonzero(~np.isfinite(flat[start : start + CHUNK_VALUES]))
        if bad.size:
            doc, token = locate(dataset.sequence_lengths, start + int(bad[0]))
            value = flat[start + int(bad[0])].item()
            raise ValueError(
                f"{what} {path_prefix}: document {doc}, token {token} holds {value!r}: every "
                "value must be finite"
            )
    pack_index_cache.mark_validated(cache_dir, key)


def locate(lengths_D: np.ndarray, flat_index: int, width: int = 1) -> tuple[int, int]:
    """``(document, token)`` of value ``flat_index`` of a file whose document d holds
    ``width * lengths_D[d]`` values."""
    ends = np.cumsum(np.asarray(lengths_D, dtype=np.int64) * width)
    # Documents are contiguous in the .bin: the first whose end passes the index holds it.
    doc = int(np.searchsorted(ends, flat_index, side="right"))
    start = int(ends[doc - 1]) if doc else 0
    return doc, (flat_index - start) // width


def add_data_identity(dataset: Any, fingerprint: str) -> None:
    """Adds ``fingerprint`` to a MegatronDataset's ``unique_identifiers`` and recomputes its
    description and hash, so its index caches (and a blend's) are keyed by the data too."""
    dataset.unique_identifiers["data_identity"] = fingerprint
    # Recomputed as MegatronDataset.__init__ computes them: the cache file names hash this.
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
