"""Refuses, at argument time, token data whose ids do not fit the run's vocabulary.

The byte-level tokenizer of ``tools/preprocess_data.py`` ends documents with id 256, so its data needs
257 ids; with ``--vocab-size 256`` the first end-of-document token indexes past Megatron's 256-row
embedding (a crash on GPU, silent garbage elsewhere). Example::

    check_vocabulary(args)   # ValueError: --vocab-size 256 (--tokenizer-type NullTokenizer):
                             #   /data/corpus.bin holds token id 256 ...
"""

import argparse
import os
import struct

import numpy as np

from megatron_ext.config.megatron_view import MegatronView

_MAGIC = b"MMIDIDX\x00\x00"
_CHUNK = 1 << 26  # ids per scanned slice: bounded memory whatever the corpus size


def _token_dtype(idx_path: str) -> np.dtype:
    """The token dtype recorded in a Megatron ``.idx`` header."""
    from megatron.core.datasets.indexed_dataset import DType

    with open(idx_path, "rb") as f:
        header = f.read(len(_MAGIC) + 9)
    if header[: len(_MAGIC)] != _MAGIC:
        raise ValueError(f"{idx_path} is not a Megatron IndexedDataset index (bad magic)")
    (code,) = struct.unpack("<B", header[len(_MAGIC) + 8 :])
    return np.dtype(DType.dtype_from_code(code))


def max_token_id(prefix: str, what: str = "--data-path", cache_dir: str | None = None) -> int:
    """The largest token id in ``prefix.bin`` (-1 when it holds no tokens), kept in ``cache_dir``
    (if given) under the identity of both files and the prefix's real path.

    Raises:
        ValueError: The ``.bin`` is not the size its ``.idx`` indexes (truncated, or written
            with another dtype than the ``.idx`` records), naming ``what`` and both files.
    """
    from megatron_ext.common.safe_files import file_identity
    from megatron_ext.data import pack_index_cache
    from megatron_ext.data.indexed_checks import open_indexed

    # Identity: inode, size, modification and status-change times. An unchanged file is read
    # once, whichever launch or rank asks; a rewritten one is read again.
    key = (
        f"max-token-id {os.path.realpath(prefix)} {file_identity(prefix + '.idx')} "
        f"{file_identity(prefix + '.bin')}"
    )
    cached = pack_index_cache.recall_ints(cache_dir, key, 1)
    if cached is not None:
        return cached[0]
    open_indexed(prefix, what)  # sizes before values: a misread .bin shows ids it never held
    dtype = _token_dtype(prefix + ".idx")
    size = os.path.getsize(prefix + ".bin") // dtype.itemsize
    largest = -1
    if size:
        # A vectorised scan of the memory-mapped file, slice by slice.
        tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(size,))
        largest = int(max(tokens[i : i + _CHUNK].max() for i in range(0, size, _CHUNK)))
    pack_index_cache.remember_ints(cache_dir, key, (largest,))
    return largest


def padded_vocab_size(args: argparse.Namespace) -> int | None:
    """Megatron's padded vocabulary size: set by its tokenizer, else derived as Megatron would
    (``NullTokenizer``: ``--vocab-size``; a local Hugging Face tokenizer: its ids, added tokens
    included, as Megatron's ``len(tokenizer)``). None when neither is known (a dry run with a
    tokenizer that is not a local file)."""
    view = MegatronView.from_args(args)
    return _padded(args, view, _unpadded_vocab_size(view))


def _padded(args: argparse.Namespace, view: MegatronView, vocab: int | None) -> int | None:
    """Megatron's padded size: its tokenizer's (``args.padded_vocab_size``), else ``vocab``
    padded by Megatron's rule (which reads ``args``)."""
    padded = view.padded_vocab_size
    if padded is not None or vocab is None:
        return padded
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    return vocab_size_with_padding(vocab, args, logging_enabled=False)


def _unpadded_vocab_size(view: MegatronView) -> int | None:
    kind = view.tokenizer_type
    if kind == "NullTokenizer":
        return view.vocab_size
    model = view.tokenizer_model
    if kind == "HuggingFaceTokenizer" and model and os.path.exists(model):
        # Megatron's own class and count (len(tokenizer)), local files only: a tokenizer it
        # cannot load here is left to its own build to report (this check is a pre-check).
        from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import (
            HuggingFaceTokenizer,
        )

        try:
            return HuggingFaceTokenizer(model).vocab_size
        except (OSError, ValueError, ImportError):
            return None
    return None


def _vocabulary_flags(view: MegatronView) -> str:
    """The flags that set the vocabulary, for the error message."""
    kind = view.tokenizer_type
    if kind == "NullTokenizer":
        return f"--vocab-size {view.vocab_size} (--tokenizer-type NullTokenizer)"
    model = view.tokenizer_model
    return (
        f"--tokenizer-model {model} (--tokenizer-type {kind})"
        if model
        else f"--tokenizer-type {kind}"
    )


def _token_prefixes(args: argparse.Namespace) -> dict[str, str]:
    """Every distinct token-data prefix of the run, each once, with the flag that names it: every
    data-path flag and the prefixes listed in a local ``--data-args-path`` /
    ``--per-split-data-args-path`` file, read as Megatron's blend parser reads them (weights are
    never mistaken for prefixes)."""
    from megatron_ext.data.data_args import data_prefixes

    found: dict[str, str] = {}
    for flag, group, _weights in data_prefixes(args):
        for prefix in group:
            found.setdefault(prefix, flag)
    return found


def check_vocabulary(args: argparse.Namespace) -> None:
    """Raises ``ValueError`` naming the vocabulary's flags and the file when a token id does not
    fit the padded embedding, or lies beyond the tokenizer's own ids (a dummy padding row)."""
    # An id inside the padded embedding but beyond the tokenizer's ids (--vocab-size 200 padded to
    # 256 rows) would train silently on a dummy row Megatron adds for GEMM-friendly sizes: data
    # written with another tokenizer than the run's.
    view = MegatronView.from_args(args)
    prefixes = {} if view.mock_data else _token_prefixes(args)
    vocab = _unpadded_vocab_size(view) if prefixes else None  # may load a tokenizer: if needed
    padded = _padded(args, view, vocab) if prefixes else None
    if padded is None:
        return
    from megatron_ext.data.indexed_checks import cache_dir_for

    for prefix, flag in prefixes.items():
        if not (os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin")):
            continue  # a missing file is reported by the data checks, naming it
        # Kept in the data cache under the file's identity: an unchanged corpus is read once.
        largest = max_token_id(
            prefix,
            f"{flag} prefix {prefix}: data",
            cache_dir_for(view.data_cache_path, prefix),
        )
        if largest >= padded:
            held = f"but the model's embedding has {padded} rows"
        elif vocab is not None and largest >= vocab:
            held = (
                f"beyond the tokenizer's {vocab} ids (a row Megatron only adds to pad the "
                f"embedding to {padded}: data written with another tokenizer?)"
            )
        else:
            continue
        raise ValueError(
            f"{_vocabulary_flags(view)}: {prefix}.bin holds token id {largest}, {held}; use a "
            f"vocabulary of at least {largest + 1} ids (the byte-level tokenizer of "
            "tools/preprocess_data.py needs 257)"
        )
