"""Shards of one corpus -> one IndexedDataset, as Megatron-LM's ``tools/merge_datasets.py``.

The shards' documents are concatenated in order (Megatron's ``IndexedDatasetBuilder.add_index``
per shard), so the output is byte-identical to Megatron's merge of the same shards::

    /d/shards/{a,b}.bin/.idx   ->   /d/all.bin/.idx   (a's documents, then b's)

Before any byte is written every shard is opened and checked (:func:`check_shards`): a missing
half of a pair, a truncated ``.bin``, or shards of different dtypes (two tokenizers, or a token
dataset beside its loss mask) are refused in one line; Megatron's script stops on the last with a
bare ``assert index.dtype == self.dtype`` after writing part of the output.
"""

import os

import numpy as np

from megatron_ext.data.indexed_checks import open_indexed
from megatron_ext.data.indexed_writer import StreamingPrefixes


def shard_prefixes(directory: str, flag: str = "--input") -> list[str]:
    """The ``.bin``/``.idx`` prefixes of a directory, sorted by name, as Megatron's merge lists
    them (other files are ignored).

    Raises:
        ValueError: Not a directory, no shard, or a ``.bin`` without its ``.idx`` (or vice versa).
    """
    if not os.path.isdir(directory):
        raise ValueError(f"{flag} {directory} is not a directory")
    halves: dict[str, set[str]] = {}
    for name in os.listdir(directory):
        stem, ext = os.path.splitext(name)
        if ext in (".bin", ".idx") and os.path.isfile(os.path.join(directory, name)):
            halves.setdefault(stem, set()).add(ext)
    for stem, exts in sorted(halves.items()):
        if len(exts) == 1:
            (have,) = exts
            missing = ".idx" if have == ".bin" else ".bin"
            raise ValueError(f"{flag} {directory}: {stem}{have} has no {stem}{missing} beside it")
    if not halves:
        raise ValueError(f"{flag} {directory} holds no .bin/.idx pair to merge")
    return [os.path.join(directory, stem) for stem in sorted(halves)]


def check_shards(prefixes: list[str], flag: str = "--input") -> type[np.number]:
    """Opens every shard (sizes checked) and returns their common dtype.

    Raises:
        ValueError: A corrupt shard, or two dtypes (naming both shards).
    """
    dtypes = {}
    for prefix in prefixes:
        dataset = open_indexed(prefix, f"{flag} shard")
        dtypes[prefix] = dataset.index.dtype
        del dataset
    first = prefixes[0]
    for prefix, dtype in dtypes.items():
        if dtype != dtypes[first]:
            raise ValueError(
                f"{flag}: {prefix}.idx holds {np.dtype(dtype).name} but {first}.idx holds "
                f"{np.dtype(dtypes[first]).name}; shards of one tokenizer have one dtype "
                "(a loss-mask sidecar or another tokenizer's data is among them)"
            )
    return dtypes[first]


def merge_shards(prefixes: list[str], output_prefix: str) -> None:
    """Writes the shards, in order, to ``output_prefix``.bin/.idx (through temporary files)."""
    dtype = check_shards(prefixes)
    with StreamingPrefixes([(output_prefix, dtype)]) as out:
        for prefix in prefixes:
            out.add_index(0, prefix)
        out.commit()
