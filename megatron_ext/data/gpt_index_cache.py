"""Megatron's ``GPTDataset`` index cache, written whole: built in a temporary directory, renamed in.

Megatron 0.19.2's ``_build_document_sample_shuffle_indices`` writes its four files straight into
the cache directory and trusts them once all four exist: a full disk or a killed writer leaves a
partial file a later run may load. Here the cache directory holds whole files or none, and a failed
write is one ``ValueError`` naming the file::

    document_index, sample_index, shuffle_index = build_indices_whole(
        dataset, super()._build_document_sample_shuffle_indices)
    # ValueError: cannot write the index cache /d/cache/...-document_index.npy (No space left ...)
"""

import copy
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from megatron_ext.common.safe_files import put_in_place

#: What Megatron writes per dataset split, in its order (each ``<hash>-<Class>-<split>-<affix>``).
AFFIXES = ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy")


def megatron_cache_dir(dataset: Any) -> str | None:
    """Where Megatron keeps ``dataset``'s index cache (None: it keeps none, mock data)."""
    config = dataset.config
    if config.path_to_cache:
        return config.path_to_cache
    if config.mock:
        return None
    return os.path.join(dataset.dataset.path_prefix, "cache", f"{type(dataset).__name__}_indices")


def _builds_here() -> bool:
    """Megatron's own rule: rank 0 builds and writes; the others load what it wrote."""
    import torch

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _release_waiting_ranks() -> None:
    """Lets the ranks waiting for rank 0's failed build go on (to refuse in one line each)."""
    # The barrier of Megatron's BlendedMegatronDatasetBuilder: without this, rank 0's exit breaks
    # it and the other ranks print a traceback.
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def build_indices_whole[T](dataset: Any, build: Callable[[], T]) -> T:
    """Runs ``build`` (Megatron's index build of ``dataset``) so that its cache files are renamed
    into place only when all are written; a failed write is a ValueError naming the file."""
    directory = megatron_cache_dir(dataset)
    config = dataset.config
    if directory is None or config.defer_npy_index_mmap or config.fast_cache_load:
        return build()  # no cache, or Megatron's lazy paths (refused by the entry)
    base = f"{dataset.unique_description_hash}-{type(dataset).__name__}-{dataset.index_split.name}"
    finals = [os.path.join(directory, f"{base}-{affix}") for affix in AFFIXES]
    # Megatron trusts the cache once all four files exist: so only whole files are put there.
    if all(map(os.path.isfile, finals)):
        return build()  # Megatron loads the cache
    if not _builds_here():  # Megatron would load what rank 0 wrote: it failed (its line says why)
        raise ValueError(
            f"the index cache {finals[1]} is not there: rank 0, which builds it, could not write "
            "it (its line names the file and the cause)"
        )
    hint = (
        "point --data-cache-path at a writable directory with room (the cache is kept beside "
        "the data unless it is given)"
    )
    try:
        os.makedirs(directory, exist_ok=True)
        # A killed builder leaves only this directory (.<hash>-<Class>-<split>.<random>.tmp),
        # which no run reads.
        temp = tempfile.mkdtemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
    except OSError as err:
        _release_waiting_ranks()
        raise ValueError(
            f"cannot write the index cache directory {directory} ({err.strerror}); {hint}"
        ) from None
    try:
        # Megatron's build unchanged, its cache path pointed at the hidden temporary directory.
        dataset.config = copy.copy(config)  # this dataset's own copy: others keep the real path
        dataset.config.path_to_cache = temp
        try:
            built = build()
        except OSError as err:
            written = [a for a in AFFIXES if os.path.exists(os.path.join(temp, f"{base}-{a}"))]
            failed = os.path.join(directory, f"{base}-{(written or [AFFIXES[0]])[-1]}")
            _release_waiting_ranks()
            raise ValueError(
                f"cannot write the index cache {failed} ({err.strerror}); {hint}"
            ) from None
        finally:
            dataset.config = config
        for affix in (*AFFIXES[1:], AFFIXES[0]):  # whole files, each renamed (same filesystem)
            put_in_place(
                os.path.join(temp, f"{base}-{affix}"), os.path.join(directory, f"{base}-{affix}")
            )
        return built
    finally:
        shutil.rmtree(temp, ignore_errors=True)
