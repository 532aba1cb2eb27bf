"""On-disk cache of pack indices, written atomically (pure numpy + os; never imports megatron).

A pack index is a few int64 arrays (:class:`~megatron_ext.data.pack_planning.PackPlan` fields).
It is saved as one ``.npz`` whose name carries a hash of everything that affects it, written to a
temporary file in the same directory and then ``os.replace``d into place: a killed writer leaves
only a stray ``.tmp`` file, and concurrent writers (all ranks build the same plan from the same
seed) each publish a complete, identical file.

Example::

    path = cache_path("/data/cache", "3f2a...", "PackedDataset", "train")
    arrays = load_or_build(path, build=lambda: {"pack_offsets_P1": np.array([0, 2])},
                           description="...")
"""

import os
import tempfile
import zipfile
from collections.abc import Callable

import numpy as np


def cache_path(cache_dir: str, description_hash: str, class_name: str, split: str) -> str:
    """Path of a pack-index cache file; the hash covers every input that changes the plan."""
    return os.path.join(cache_dir, f"{description_hash}-{class_name}-{split}-packs.npz")


def save_atomically(path: str, arrays: dict[str, np.ndarray], description: str) -> None:
    """Writes ``arrays`` (and a human-readable ``description``) to ``path`` via temp + rename."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, description=np.array(description), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(path: str, keys: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """Loads a cache file written by :func:`save_atomically` (``keys`` None = all arrays).

    Raises:
        ValueError: The file is not a readable pack index or lacks one of ``keys``; the message
            names the file (delete it to rebuild).
    """
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files if k != "description"}
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, AttributeError) as err:
        raise ValueError(
            f"pack-index cache {path} is corrupt ({err}); delete it to rebuild"
        ) from err
    missing = [k for k in keys or () if k not in arrays]
    if missing:
        raise ValueError(f"pack-index cache {path} lacks {missing}; delete it to rebuild")
    return arrays


def load_or_build(
    path: str | None,
    build: Callable[[], dict[str, np.ndarray]],
    description: str,
    keys: tuple[str, ...] | None = None,
) -> tuple[dict[str, np.ndarray], bool]:
    """Returns the cached arrays at ``path`` or builds, saves and returns them.

    Args:
        path: Cache file, or None to always build without saving.
        build: Computes the arrays.
        description: Saved alongside (what the hash stands for).
        keys: Arrays a cached file must hold.

    Returns:
        ``(arrays, cache_hit)``.
    """
    if path is not None and os.path.isfile(path):
        return load(path, keys), True
    arrays = build()
    if path is not None:
        save_atomically(path, arrays, description)
    return arrays, False
