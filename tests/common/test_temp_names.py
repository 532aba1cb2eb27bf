"""Tests for megatron_ext.common.temp_names. Tier: pure (os, files, real processes killed)."""

import errno
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_ext.common import temp_names
from megatron_ext.common.safe_files import create_temp
from megatron_ext.common.temp_names import move_no_replace, remove_stale_temps, temp_name


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(proc.stdout)


def test_a_killed_writers_temporary_file_is_removed_by_the_next_with_a_warning(tmp_path) -> None:
    """A real writer SIGKILLed between creating its temporary file and renaming it."""
    out = str(tmp_path / "corpus.bin")
    script = textwrap.dedent(f"""
        import os, signal
        from megatron_ext.common.safe_files import create_temp
        fd, tmp = create_temp({out!r})
        os.write(fd, b"half a corpus")
        print(tmp, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=False, env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    assert proc.returncode == -9, proc.stderr
    left = proc.stdout.strip()
    assert os.path.dirname(left) == str(tmp_path) and os.path.exists(left)  # what a kill leaves
    with pytest.warns(UserWarning, match=rf"removed {left}: a temporary file left by process"):
        fd, mine = create_temp(out)
    os.close(fd)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(mine)]


def test_only_this_hosts_files_of_gone_processes_are_stale(tmp_path) -> None:
    base = "x.idx"
    dead = f".{base}.{temp_names._host()}.{_dead_pid()}.0123456789ab.tmp"
    alive = f".{base}.{temp_names._host()}.{os.getppid()}.0123456789ab.tmp"  # our parent
    other_host = f".{base}.elsewhere.{_dead_pid()}.0123456789ab.tmp"
    other_output = f".y.idx.{temp_names._host()}.{_dead_pid()}.0123456789ab.tmp"
    legacy = f".{base}.0123456789ab.tmp"  # named before the owner was recorded: unknown owner
    for name in (dead, alive, other_host, other_output, legacy):
        (tmp_path / name).write_bytes(b"")
    with pytest.warns(UserWarning) as caught:
        assert remove_stale_temps(str(tmp_path), base) == [str(tmp_path / dead)]
    assert len(caught) == 1
    assert sorted(os.listdir(tmp_path)) == sorted([alive, other_host, other_output, legacy])
    assert temp_names._owner(temp_name(base), base) == (temp_names._host(), os.getpid())


def _move_both_ways(tmp_path) -> None:
    src, dst = tmp_path / "a.tmp", tmp_path / "a"
    src.write_bytes(b"first")
    move_no_replace(str(src), str(dst))
    assert dst.read_bytes() == b"first" and not src.exists()
    src.write_bytes(b"second")
    with pytest.raises(FileExistsError):
        move_no_replace(str(src), str(dst))
    assert dst.read_bytes() == b"first" and src.read_bytes() == b"second"


def test_move_no_replace_with_hard_links(tmp_path) -> None:
    _move_both_ways(tmp_path)


def test_move_no_replace_without_hard_links_uses_renameat2(tmp_path, monkeypatch) -> None:
    """A filesystem without hard links (link() fails with EPERM): Linux's renameat2 with
    RENAME_NOREPLACE, called for real."""
    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux's")

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    calls = []
    real = temp_names._renameat2_no_replace

    def counted(src, dst):
        calls.append(real(src, dst))
        return calls[-1]

    monkeypatch.setattr(temp_names.os, "link", no_links)
    monkeypatch.setattr(temp_names, "_renameat2_no_replace", counted)
    _move_both_ways(tmp_path)
    assert calls == [True], calls  # the first move renamed through it; the second raised in it


def test_move_no_replace_with_neither_checks_then_renames(tmp_path, monkeypatch) -> None:
    def unsupported(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(temp_names.os, "link", unsupported)
    monkeypatch.setattr(temp_names, "_renameat2_no_replace", lambda src, dst: False)
    _move_both_ways(tmp_path)
