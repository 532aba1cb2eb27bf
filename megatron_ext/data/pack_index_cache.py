"""On-disk cache of pack indices, written atomically (pure numpy + os; never imports megatron).

A pack index is saved as one ``.npz`` named by a hash of the flags, the layout's version and the
data's identity (rewritten data at the same prefix gets a new plan), its full description stored
inside and compared on load. Whole-file checks and scans leave a small marker keyed by the file's
identity (:func:`validated`, :func:`recall`), so a restart does not read the file again::

    path = cache_path("/data/cache", "3f2a...", "PackedDataset", "train")
    arrays = load_or_build(path, build=lambda: {"pack_offsets_P1": np.array([0, 2])},
                           description="...")
"""

import contextlib
import hashlib
import logging
import os
import zipfile
from collections.abc import Callable

import numpy as np

from megatron_ext.common.safe_files import atomic_write_bytes, create_temp, put_in_place

logger = logging.getLogger(__name__)


def cache_path(cache_dir: str, description_hash: str, class_name: str, split: str) -> str:
    """Path of a pack-index cache file; the hash covers every input that changes the plan."""
    return os.path.join(cache_dir, f"{description_hash}-{class_name}-{split}-packs.npz")


def save_atomically(path: str, arrays: dict[str, np.ndarray], description: str) -> None:
    """Writes ``arrays`` (and a human-readable ``description``) to ``path`` via temp + rename."""
    _make_cache_dir(path)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, description=np.array(description), **arrays)
            f.flush()
            os.fsync(f.fileno())
        # megatron_ext's one publish: a killed writer leaves only a stray temporary file (removed
        # by the next writer); concurrent writers (every rank plans the same packs from the same
        # seed) each publish a complete, identical file. Mode 0o666 minus the umask, group-readable
        # like Megatron's caches.
        put_in_place(tmp, path)
    except OSError as err:  # a full disk or quota, mid-write: nothing is left behind
        raise ValueError(
            f"cannot write the index cache {path} ({err.strerror}); free space there or point "
            "--data-cache-path at a writable directory with room (the cache is kept beside the "
            "data unless it is given)"
        ) from err
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _make_cache_dir(path: str) -> None:
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"cannot create the index cache directory {directory} ({err.strerror}); point "
            "--data-cache-path at a writable directory"
        ) from err


def _create_temp(path: str) -> tuple[int, str]:
    try:
        return create_temp(path)
    except OSError as err:
        raise ValueError(
            f"cannot write the index cache {path} ({err.strerror}); point --data-cache-path at "
            "a writable directory (the cache is kept beside the data unless it is given)"
        ) from err


def load(
    path: str, keys: tuple[str, ...] | None = None, with_description: bool = False
) -> dict[str, np.ndarray]:
    """Loads a cache file written by :func:`save_atomically`, which must hold ``keys``.

    ``with_description``: also return the stored description under ``"description"``.

    Raises:
        ValueError: An unreadable file or one lacking a key, naming it (delete it to rebuild).
    """
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files if with_description or k != "description"}
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
    """``(arrays, cache_hit)``: the cached arrays at ``path``, else ``build()``'s, saved there.

    ``path`` None: always build, never save. ``description`` (what the hash stands for) is saved
    alongside; a cached file that holds another is rebuilt and replaced, never reused.
    """
    if path is not None and os.path.isfile(path):
        arrays = load(path, keys, with_description=True)
        stored = str(arrays.pop("description", ""))
        if stored == description:  # else copied in, or a hash collision: rebuilt, never reused
            return arrays, True
        logger.warning("index cache %s was built for other data or flags; rebuilding it", path)
    arrays = build()
    if path is not None:
        save_atomically(path, arrays, description)
    return arrays, False


def _marker_path(cache_dir: str, key: str, suffix: str = "validated") -> str:
    # The key (paths, identities) is no file name: hash it, and store it inside so a hash
    # collision reads as "not validated".
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=16).hexdigest()
    return os.path.join(cache_dir, f"{digest}-{suffix}.txt")


def validated(cache_dir: str | None, key: str) -> bool:
    """True if :func:`mark_validated` recorded ``key`` (a check's name plus file identities)."""
    if cache_dir is None:
        return False
    try:
        with open(_marker_path(cache_dir, key), encoding="utf-8") as f:
            return f.read() == key
    except (OSError, UnicodeDecodeError):
        return False


def mark_validated(cache_dir: str | None, key: str) -> None:
    """Records that the check ``key`` passed (best effort: an unwritable cache only costs time)."""
    if cache_dir is None:
        return
    path = _marker_path(cache_dir, key)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        atomic_write_bytes(path, key.encode("utf-8"))
    except OSError as err:
        logger.warning("could not record validation in %s (%s)", path, err.strerror)


def recall(cache_dir: str | None, key: str) -> str | None:
    """The value :func:`remember` stored under ``key`` (a scan's name plus file identities), or
    None when there is none (or it was stored under another key that hashes alike)."""
    if cache_dir is None:
        return None
    try:
        with open(_marker_path(cache_dir, key, "value"), encoding="utf-8") as f:
            stored_key, _, value = f.read().partition("\n")
    except (OSError, UnicodeDecodeError):
        return None
    return value if stored_key == key else None


def remember(cache_dir: str | None, key: str, value: str) -> None:
    """Stores a scan's result under ``key`` (best effort, like :func:`mark_validated`)."""
    if cache_dir is None:
        return
    if "\n" in key:
        raise ValueError(f"a cache key holds no newline: {key!r}")
    path = _marker_path(cache_dir, key, "value")
    try:
        os.makedirs(cache_dir, exist_ok=True)
        atomic_write_bytes(path, f"{key}\n{value}".encode())
    except OSError as err:
        logger.warning("could not record a scan's result in %s (%s)", path, err.strerror)


def recall_ints(cache_dir: str | None, key: str, count: int) -> tuple[int, ...] | None:
    """The ``count`` integers :func:`remember_ints` stored under ``key`` (a scan's result), or None
    when there are none (or not ``count`` integers: another layout of the value)."""
    value = recall(cache_dir, key)
    if value is None:
        return None
    try:
        ints = tuple(int(word) for word in value.split(" "))
    except ValueError:
        return None
    return ints if len(ints) == count else None


def remember_ints(cache_dir: str | None, key: str, ints: tuple[int, ...]) -> None:
    """Stores a scan's integer result under ``key`` (best effort, like :func:`remember`)."""
    remember(cache_dir, key, " ".join(str(int(v)) for v in ints))
