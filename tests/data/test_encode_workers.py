"""Tier: processes with real signals. ``tools/preprocess_data.py --workers 2`` when a worker dies
(SIGKILL while it holds a chunk) and when the tool itself is killed (``kill -9``): the tool ends
with one line naming the file and the lost lines, exit status 2, nothing written, and no worker is
left behind (megatron_ext.data.encode_workers).

The tool runs in a child forked from this process (which imported Megatron: the tool's 6 s import
is skipped), in a session of its own, so everything it starts can be found and cleaned up. A worker
stops itself (SIGSTOP) when it takes the first chunk: the test then knows which worker holds which
chunk, and the kill is the test's, from outside.
"""

import json
import os
import signal
import sys
import time
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

import psutil
import pytest

import megatron_ext.data.jsonl_indexed  # noqa: F401  (imported here, not in each forked tool)
from megatron_ext.data import encode_workers
from megatron_ext.data.tool_errors import run_tool
from megatron_ext.testing.processes import (
    exit_status,
    fork_main,
    in_session,
    kill_session,
    running,
    wait_ended,
)

TOOL = Path(__file__).resolve().parents[2] / "tools" / "preprocess_data.py"
#: Lines per chunk in the forked tool: 12 records make 3 chunks (lines 1-4, 5-8, 9-12).
CHUNK_LINES = 4
TIMEOUT_S = 60


_ENCODE = encode_workers._encode_in_worker


def _stops_on_the_first_chunk(task: tuple[int, list[bytes]]):
    """The worker's function in the forked tool: the worker that takes lines 1-4 stops there."""
    if task[0] == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    return _ENCODE(task)


def _tool(argv: list[str]) -> int:
    """``python tools/preprocess_data.py ARGV`` in the forked child, with 4-line chunks and the
    worker function that stops on the first chunk."""
    spec = spec_from_file_location("preprocess_data", TOOL)
    tool = module_from_spec(spec)
    spec.loader.exec_module(tool)
    sys.argv = [str(TOOL), *argv]
    encode_workers.CHUNK_LINES = CHUNK_LINES
    encode_workers._encode_in_worker = _stops_on_the_first_chunk
    return run_tool(tool.main)


def _stopped_worker(tool: int) -> int:
    """The pid of the tool's worker that stopped itself (waits for it)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for child in psutil.Process(tool).children():
            try:
                if child.status() == psutil.STATUS_STOPPED:
                    return child.pid
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.02)
    raise AssertionError(f"no worker of the tool stopped in {TIMEOUT_S} s")


@pytest.fixture
def started(tmp_path):
    """The tool started on 12 records with --workers 2, once a worker stopped on the first chunk:
    its pid, its workers', its output log. Whatever of its session is left is killed after."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(12)))
    log = tmp_path / "tool.log"
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "out"), "--workers", "2"]
    tool = fork_main(lambda: _tool(argv), log)
    try:
        _stopped_worker(tool)
        workers = [child.pid for child in psutil.Process(tool).children()]
        assert len(workers) == 2, workers
        yield tool, workers, log
    finally:
        kill_session(tool)


def test_a_dead_worker_ends_the_tool_with_one_line_naming_the_chunk(started, tmp_path) -> None:
    """multiprocessing.Pool replaced the dead worker and waited for the lost chunk forever."""
    tool, workers, log = started
    os.kill(_stopped_worker(tool), signal.SIGKILL)
    status = exit_status(tool, TIMEOUT_S)
    errors = log.read_text().splitlines()
    assert status == 2, errors
    src = tmp_path / "in.jsonl"
    assert errors[-1] == (
        f"preprocess_data.py: error: {src} lines 1-4: a worker process died before they were "
        "encoded (killed, or out of memory?)"
    )
    assert not any("Traceback" in line or "error" in line for line in errors[:-1]), errors
    assert wait_ended(workers, timeout=10) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "tool.log"]  # no output


def test_the_workers_die_with_a_killed_tool(started) -> None:
    """``kill -9`` of the tool: its workers (one holding a chunk) end with it, not orphaned."""
    tool, workers, _log = started
    assert running(workers) == workers
    os.kill(tool, signal.SIGKILL)
    assert exit_status(tool, TIMEOUT_S) == -signal.SIGKILL
    assert wait_ended(workers, timeout=10) == []
    assert in_session(tool) == []
