"""Directories on a full or read-only filesystem, for the tests of what a write there does.

A full disk is a real one: a tmpfs a few pages large, whose writes the kernel refuses with ENOSPC
(an injected ``OSError`` would test only the handler; ``RLIMIT_FSIZE`` gives EFBIG, "File too
large", not what a full disk says). Mounting needs root (CI's containers and this project's
development machines run as root); elsewhere the test is skipped, saying why. A read-only directory
is ``chmod 0o555`` for a user, which root ignores: root gets a tmpfs mounted read-only.
"""

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str = "8k", read_only: bool = False) -> Iterator[Path]:
    """``path``, a new directory with a tmpfs of ``size`` mounted on it (unmounted after)."""
    path.mkdir(parents=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """``path``, a new directory no write into succeeds (chmod for a user, a read-only tmpfs
    for root)."""
    if os.geteuid() == 0:
        with tiny_tmpfs(path, read_only=True):
            yield path
        return
    path.mkdir(parents=True)
    path.chmod(0o555)
    try:
        yield path
    finally:
        path.chmod(0o755)
