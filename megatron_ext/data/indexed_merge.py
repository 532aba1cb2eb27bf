"""Shards of one corpus -> one IndexedDataset, as Megatron-LM's ``tools/merge_datasets.py``.

Byte-identical to Megatron's merge of the same shards (its ``add_index`` per shard, in order);
every shard is checked before any byte is written::

    /d/shards/{a,b}.bin/.idx   ->   /d/all.bin/.idx   (a's documents, then b's)
"""

import os

import numpy as np

from megatron_ext.data.indexed_checks import check_shard
from megatron_ext.data.indexed_writer import StreamingPrefixes


def shard_prefixes(directory: str, flag: str = "--input") -> list[str]:
    """The ``.bin``/``.idx`` prefixes of a directory, sorted by name, as Megatron's merge lists
    them; ValueError for no pair or half of one."""
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
    """Checks every shard (:func:`check_shard`) and returns their common dtype.

    An empty shard (an ``.idx`` of no token) adds nothing wherever it falls, as in Megatron's
    ``add_index``; only a merge of nothing but empty shards is refused.

    Raises:
        ValueError: A corrupt shard, one named twice, two dtypes, or no token in any shard.
    """
    # Megatron's script stops on a bare ``assert index.dtype == self.dtype`` after writing part of
    # its output, and merges a shard named twice twice: both are refused before any write.
    check_distinct(prefixes, flag)
    dtypes = {prefix: check_shard(prefix, f"{flag} shard") for prefix in prefixes}
    first = prefixes[0]
    for prefix, dtype in dtypes.items():
        if dtype != dtypes[first]:
            raise ValueError(
                f"{flag}: {prefix}.idx holds {np.dtype(dtype).name} but {first}.idx holds "
                f"{np.dtype(dtypes[first]).name}; shards of one tokenizer have one dtype "
                "(a loss-mask sidecar or another tokenizer's data is among them)"
            )
    if all(os.path.getsize(prefix + ".bin") == 0 for prefix in prefixes):
        raise ValueError(
            f"{flag}: every shard's .bin is empty ({', '.join(prefixes)}): the merge would hold "
            "no token (Megatron cannot open an empty .bin)"
        )
    return dtypes[first]


def check_distinct(prefixes: list[str], flag: str = "--input") -> None:
    """Refuses (naming both) two prefixes whose ``.bin`` or ``.idx`` is one file: the same path,
    a symlink, a hard link (the same device and inode)."""
    seen: dict[tuple[int, int], int] = {}
    for i, prefix in enumerate(prefixes):
        for ext in (".bin", ".idx"):
            try:
                st = os.stat(prefix + ext)
            except FileNotFoundError:
                continue  # named by check_shard
            j = seen.setdefault((st.st_dev, st.st_ino), i)
            if j != i:
                earlier = prefixes[j]
                same = (
                    f"{prefix} is given twice"
                    if earlier == prefix
                    else f"{earlier} and {prefix} are the same shard ({earlier}{ext} and "
                    f"{prefix}{ext} are one file)"
                )
                raise ValueError(f"{flag}: {same}; merging it twice would repeat its documents")


def merge_shards(prefixes: list[str], output_prefix: str, flag: str = "--input") -> None:
    """Writes the shards, in order, to ``output_prefix``.bin/.idx (through temporary files)."""
    dtype = check_shards(prefixes, flag)
    with StreamingPrefixes([(output_prefix, dtype)]) as out:
        for prefix in prefixes:
            out.add_index(0, prefix)
        out.commit()
