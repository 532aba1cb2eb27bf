"""Output files that never lose data, and identities of input data (pure os + numpy).

Every file megatron_ext writes goes to a temporary file in its target directory and is put in place
at the end (:func:`publish`), and outputs are checked *before* the work (docs/data.md, "Tools")::

    check_output_prefix("/d/sft", flag="--output-prefix", inputs=["/d/sft.jsonl"], overwrite=False)
    # ValueError if /d/sft.bin or /d/sft.idx exists
"""

import contextlib
import hashlib
import os
from collections.abc import Iterable, Iterator

import numpy as np

from megatron_ext.common.temp_names import move_no_replace, remove_stale_temps, temp_name

#: The two files of a Megatron IndexedDataset prefix, in the order they are published.
INDEXED_EXTENSIONS = (".bin", ".idx")

#: Absolute paths of outputs this process checked (:func:`check_output_file`) while they did not
#: exist: they are published without replacing (:func:`put_in_place`), so two runs writing the
#: same fresh output cannot both succeed, one silently replacing the other.
_NEW_OUTPUTS: set[str] = set()


def create_temp(path: str) -> tuple[int, str]:
    """``(fd, temp_path)``: a new, empty temporary file beside ``path``, its directory created if
    missing; the caller writes, then :func:`publish` es or unlinks it."""
    # Mode 0o666 minus the umask (mkstemp's 0o600 would hide caches from the group, unlike
    # Megatron's own). The name records this host and process (temp_names): a gone writer's
    # files of path are removed first, with a warning naming each.
    directory, base = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_stale_temps(directory, base)
    while True:
        tmp = os.path.join(directory, temp_name(base))
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue


def fsync_path(path: str) -> None:
    """Flushes a closed file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(pairs: Iterable[tuple[str, str]]) -> None:
    """Puts every ``(temp, final)`` in place as one commit: first removes every existing final
    that may be replaced, then puts the temps in place in order, every ``.idx`` last (after its
    ``.bin`` and companions such as a route header).

    A final absent when checked is never replaced: if another writer made it meanwhile, this
    commit's new finals are taken back (ValueError naming it).
    """
    # A crash at any point leaves each prefix with all its new files or no .idx (refused at
    # load): renaming over the old files would leave a window (new .bin beside the old .idx)
    # where a pair of the same total size loads as misaligned documents, and an .idx renamed
    # before a companion would load without it. A job mapping an old file keeps its inode.
    pairs = list(pairs)
    for _tmp, final in pairs:
        if os.path.abspath(final) not in _NEW_OUTPUTS:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(final)
    pairs.sort(key=lambda pair: pair[1].endswith(".idx"))  # stable: the given order otherwise
    placed: list[tuple[str, tuple[int, int]]] = []  # new outputs this commit put in place
    try:
        for tmp, final in pairs:
            inode = _inode(tmp)
            if put_in_place(tmp, final):
                placed.append((final, inode))
    except ValueError:
        for final, inode in placed:  # ours (our temp's inode), never what another writer made
            with contextlib.suppress(FileNotFoundError):
                if _inode(final) == inode:
                    os.unlink(final)
        raise


def put_in_place(tmp: str, final: str) -> bool:
    """Renames ``tmp`` to ``final`` and returns whether it was a new output (absent when checked),
    which is never replaced: ValueError if another writer created it after the check."""
    key = os.path.abspath(final)
    if key not in _NEW_OUTPUTS:
        os.replace(tmp, final)
        return False
    try:
        move_no_replace(tmp, final)
    except FileExistsError as err:
        raise ValueError(
            f"{final} was created by another writer while this one ran (it did not exist when "
            "checked); it is left as that writer made it and this output is discarded"
        ) from err
    _NEW_OUTPUTS.discard(key)
    return True


def _inode(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file and a rename."""
    fd, tmp = create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        put_in_place(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def temp_paths(finals: list[str]) -> Iterator[list[str]]:
    """Temporary paths beside ``finals``; whatever is left of them is removed on exit."""
    temps = []
    try:
        for final in finals:
            fd, tmp = create_temp(final)
            os.close(fd)
            temps.append(tmp)
        yield temps
    finally:
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


#: Values :func:`lengths_fingerprint` widens to int64 at a time (a 512 KiB temporary).
FINGERPRINT_CHUNK_VALUES = 1 << 16


def lengths_fingerprint(lengths: np.ndarray) -> str:
    """Identity of an index's sequence lengths: ``"<count>:<blake2b of the int64 lengths>"``: a
    plan or sample index built from them is valid exactly for data with the same fingerprint."""
    # The lengths as native int64 in C order whatever their dtype (caches are keyed by it: it
    # must never change); other dtypes (the .idx's int32) widened chunk by chunk, never copied
    # whole.
    flat = np.asarray(lengths).reshape(-1)  # a view unless the input is not C-contiguous
    hasher = hashlib.blake2b(digest_size=16)
    if flat.dtype == np.int64 and flat.flags.c_contiguous:
        hasher.update(flat)
    else:
        for start in range(0, flat.size, FINGERPRINT_CHUNK_VALUES):
            hasher.update(flat[start : start + FINGERPRINT_CHUNK_VALUES].astype(np.int64))
    return f"{flat.size}:{hasher.hexdigest()}"


#: Bytes :func:`content_digest` reads at a time.
DIGEST_CHUNK_BYTES = 8 << 20


def content_digest(paths: Iterable[str]) -> str:
    """blake2b-128 of the files' bytes, in order, each preceded by its size: a content, not a
    state (equal for a byte-identical copy, different for any rewritten byte)."""
    hasher = hashlib.blake2b(digest_size=16)
    for path in paths:
        hasher.update(os.path.getsize(path).to_bytes(8, "little"))
        with open(path, "rb") as f:
            while chunk := f.read(DIGEST_CHUNK_BYTES):
                hasher.update(chunk)
    return hasher.hexdigest()


def file_identity(path: str) -> str:
    """One state of a file without reading it: ``"inode:size:mtime_ns:ctime_ns"``."""
    # Changes on a rewrite by rename (new inode) or in place: a write moves the status change
    # time, which, unlike the mtime (touch -d, os.utime, cp -p), no user call can set back.
    st = os.stat(path)
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_writable_dir(path: str, flag: str) -> None:
    """Refuses an output under a file or in a directory (or missing directory's first existing
    ancestor, where it would be created) that is not writable."""
    directory = os.path.dirname(os.path.abspath(path))
    probe = directory
    while not os.path.exists(probe):  # the first existing ancestor decides
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{flag} {path}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):  # the directory, or where it would be created
        raise ValueError(f"{flag} {path}: directory {probe} is not writable")


def check_output_file(
    path: str,
    *,
    flag: str,
    inputs: Iterable[str] = (),
    overwrite: bool = False,
    replace_hint: str = "pass --overwrite to replace it",
) -> None:
    """Refuses (ValueError naming ``flag`` and the file) writing ``path`` if it exists (without
    ``overwrite``; ``replace_hint`` says what to do instead) or is one of ``inputs``."""
    if path == "":
        raise ValueError(f"{flag} must not be empty")
    for source in inputs:
        if os.path.exists(source) and _same_file(path, source):
            raise ValueError(f"{flag} {path} is an input ({source}); writing it would destroy it")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory")
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"{flag} {path} already exists; {replace_hint}")
    check_writable_dir(path, flag)
    # Remembered as new if absent now: publishing it then never replaces what another run made.
    if os.path.lexists(path):
        _NEW_OUTPUTS.discard(os.path.abspath(path))  # replacing it is what was asked
    else:
        _NEW_OUTPUTS.add(os.path.abspath(path))


def check_output_prefix(
    prefix: str,
    *,
    flag: str,
    inputs: Iterable[str] = (),
    overwrite: bool = False,
    extensions: tuple[str, ...] = INDEXED_EXTENSIONS,
    replace_hint: str = "pass --overwrite to replace it",
    input_files: Iterable[str] = (),
) -> None:
    """:func:`check_output_file` for every ``prefix + extension`` of an IndexedDataset output;
    ``inputs`` may be prefixes (their ``.bin``/``.idx`` count), ``input_files`` are files only."""
    # input_files: a JSONL named d/in.jsonl does not make d/in.jsonl.bin an input.
    if prefix == "" or prefix.endswith(os.sep):
        raise ValueError(f"{flag} {prefix!r} must name a file prefix, not a directory")
    sources = list(input_files)
    for source in inputs:
        sources += [source] + [source + ext for ext in INDEXED_EXTENSIONS]
    for ext in extensions:
        check_output_file(
            prefix + ext,
            flag=flag,
            inputs=sources,
            overwrite=overwrite,
            replace_hint=replace_hint,
        )


def remove_prefix_files(prefix: str, extensions: tuple[str, ...] = INDEXED_EXTENSIONS) -> list[str]:
    """Removes ``prefix + ext`` files that exist (stale sidecars of a rewritten prefix)."""
    removed = []
    for ext in extensions:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(prefix + ext)
            removed.append(prefix + ext)
    return removed
