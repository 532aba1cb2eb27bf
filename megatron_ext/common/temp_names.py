"""Temporary files that say who made them, and a rename that never replaces (pure os + ctypes).
The next writer of an output removes the temporary files a gone process of this host left::

    .corpus.bin.node7.81234.5f0c2a9e11d3.tmp      (hidden, beside corpus.bin)
"""

import ctypes
import ctypes.util
import errno
import os
import re
import secrets
import socket
import warnings

#: ``renameat2`` flag: fail with EEXIST instead of replacing (linux/fs.h).
RENAME_NOREPLACE = 1
_AT_FDCWD = -100
#: errnos of a filesystem (or kernel) that cannot do the operation at all, as opposed to a failure.
_UNSUPPORTED = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


def _host() -> str:
    """This host's name as it appears in temporary names (dots kept, anything unusual a dash)."""
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()) or "host"


def temp_name(base: str) -> str:
    """The hidden name of a new temporary file for the output named ``base``."""
    return f".{base}.{_host()}.{os.getpid()}.{secrets.token_hex(6)}.tmp"


def _owner(name: str, base: str) -> tuple[str, int] | None:
    """``(host, pid)`` recorded in ``name`` if it is a temporary file of ``base``, else None."""
    match = re.fullmatch(re.escape(f".{base}.") + r"(.+)\.(\d+)\.[0-9a-f]{12}\.tmp", name)
    return (match.group(1), int(match.group(2))) if match else None


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one this process may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(directory: str, base: str) -> list[str]:
    """Removes the temporary files of ``base`` in ``directory`` that a process of this host left
    and that is gone, warning once per file. Returns their paths."""
    host, removed = _host(), []
    try:
        entries = [e.name for e in os.scandir(directory) if e.name.startswith(f".{base}.")]
    except FileNotFoundError:
        return removed
    # Another host's files, and those of a live process (or one this process may not signal), are
    # left alone. A container sharing the host name and directory but not the pid namespace is
    # the one case where a live writer's file looks stale; that writer's rename then fails.
    for name in entries:
        owner = _owner(name, base)
        if owner is None or owner[0] != host or owner[1] == os.getpid():
            continue
        if process_alive(owner[1]):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
        except FileNotFoundError:  # another writer removed it first
            continue
        warnings.warn(
            f"removed {path}: a temporary file left by process {owner[1]} of this host, which is "
            "gone (killed before it could rename it)",
            stacklevel=2,
        )
        removed.append(path)
    return removed


def move_no_replace(src: str, dst: str) -> None:
    """Moves ``src`` to ``dst`` (same directory) unless ``dst`` exists (FileExistsError, ``src``
    left where it was)."""
    # A hard link (fails if the name exists) then an unlink; without hard links Linux's
    # renameat2(RENAME_NOREPLACE); only without both a check and rename.
    try:
        os.link(src, dst)
    except OSError as err:
        if err.errno not in _UNSUPPORTED:
            raise  # FileExistsError among them
    else:
        os.unlink(src)
        return
    if not _renameat2_no_replace(src, dst):
        if os.path.lexists(dst):  # neither primitive: the one check-then-rename window left
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
        os.replace(src, dst)


def _renameat2_no_replace(src: str, dst: str) -> bool:
    """``renameat2(src, dst, RENAME_NOREPLACE)``; False where the kernel, libc or filesystem
    lacks it (nothing done); FileExistsError if ``dst`` exists."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    result = renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    if code == errno.EEXIST:
        raise FileExistsError(code, os.strerror(code), dst)
    raise OSError(code, os.strerror(code), dst)


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None
