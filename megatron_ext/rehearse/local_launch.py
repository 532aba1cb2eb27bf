"""Launches ``python -m megatron_ext.pretrain_gpt --cpu`` on gloo ranks and reads what the loop logged.

For ``megatron-ext demo``, ``megatron-ext rehearse`` and the tests: Megatron's real ``pretrain`` runs in
fresh processes (2 gloo ranks by default), each with the environment torchrun gives its workers, and
the returned :class:`LoopRun` parses Megatron's iteration lines (``lm loss``, ``load_balancing_loss``,
...) and megatron_ext's expert-load lines from the output.

Example::

    run = launch(["--data-path", prefix, "--train-iters", "4", ...])
    run.check()                       # raises with the log tail if the launch failed
    run.losses                        # {1: 5.97, 2: 5.89, ...}
"""

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.rehearse import rank_server as server
from megatron_ext.rehearse.rank_env import free_port, rank_env

__all__ = ["LoopRun", "free_port", "launch"]

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
# A field name may end in a parenthesised unit: "elapsed time per iteration (ms)", and hold a
# slash: "rl/logprob_mismatch".
_FIELD = re.compile(r"([A-Za-z0-9_ /]+?(?: \([^()|:]*\))?):\s+([-+0-9.eE]+|nan|inf) \|")


@dataclass
class LoopRun:
    """One finished launch: its command, exit status and output."""

    argv: list[str]
    returncode: int
    output: str
    #: The ranks were forked from the preloaded server, not started as fresh interpreters.
    preloaded: bool = False
    #: Why they were not: the variables whose value differs from the server's environment.
    not_forked_because: list[str] = field(default_factory=list)
    iterations: dict[int, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for line in self.output.splitlines():
            match = _ITERATION.search(line)
            if match:
                fields = {k.strip(): float(v) for k, v in _FIELD.findall(match.group(2) + " |")}
                self.iterations[int(match.group(1))] = fields

    @property
    def losses(self) -> dict[int, float]:
        """``lm loss`` per logged iteration."""
        return {i: f["lm loss"] for i, f in self.iterations.items() if "lm loss" in f}

    def check(self) -> "LoopRun":
        """Raises ``AssertionError`` with the end of the log unless the launch succeeded."""
        if self.returncode != 0:
            tail = "\n".join(self.output.splitlines()[-60:])
            raise AssertionError(f"launch failed ({self.returncode}):\n{tail}")
        return self


def launch(
    args: list[str] | tuple[str, ...],
    *,
    nproc: int = 2,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    module: str = "megatron_ext.pretrain_gpt",
    cwd: str | Path | None = None,
    preload: bool = True,
    ranks: tuple[int, ...] | None = None,
) -> LoopRun:
    """Runs ``python -m module *args`` on ``nproc`` ranks, each with the environment torchrun gives
    its workers, and returns what they printed (one stream, as torchrun's).

    No torchrun agent process: it is one more interpreter importing torch before the ranks start
    (about 3 s of a 13 s fresh two-rank launch on a 2-core machine). Like the agent, the first rank to
    fail stops the others (a peer still waiting for it, in the rendezvous for one, would wait 30
    minutes); the launch's return code is that rank's. The examples' own torchrun path is run by
    tests/training/test_real_loop_examples.py and the demo.

    With ``preload`` (the default) the ranks are forked from a server that imported Megatron once
    (:mod:`megatron_ext.rehearse.rank_server`): a launch then skips about 6 s of imports and 1.7 s of
    interpreter teardown per rank, and runs the same ``python -m module`` code. It falls back to
    fresh interpreters when the environment is neither the one the server started under nor the
    one its imports left (``env`` setting an import-time variable, say), and ``LoopRun.preloaded``
    says which path ran.

    ``ranks`` starts only those ranks of the ``nproc``-rank world (e.g. ``(0,)`` for a ``--dry-run``,
    which joins no process group).

    Raises:
        subprocess.TimeoutExpired: The ranks ran past ``timeout`` seconds (all are killed); its
            ``output`` holds what they printed until then.
    """
    port = str(free_port())
    argv = [sys.executable, "-m", module, *args]
    base_env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    started = range(nproc) if ranks is None else ranks
    rank_envs = [{**base_env, **rank_env(rank, nproc, port)} for rank in started]
    differs = server.import_environment_differs(base_env) if preload else []
    forked = preload and not differs
    with tempfile.NamedTemporaryFile("w+", prefix="megatron_ext_launch_") as out:
        if forked:
            workdir = str(Path(cwd or os.getcwd()).resolve())
            procs = [server.Rank(module, list(args), e, workdir, out.name) for e in rank_envs]
        else:
            procs = [
                subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=e
                )
                for e in rank_envs
            ]
        try:
            returncode = _wait_first_failure(procs, argv, timeout)
        except subprocess.TimeoutExpired as err:
            out.seek(0)
            err.output = out.read()  # what the ranks printed before they were stopped
            raise
        out.seek(0)
        return LoopRun(
            argv=argv,
            returncode=returncode,
            output=out.read(),
            preloaded=forked,
            not_forked_because=differs,
        )


def _wait_first_failure(procs: list, argv: list[str], timeout: float) -> int:
    """Waits for every rank; the first to fail stops the rest. Returns its code (0: all passed)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is not None or all(c == 0 for c in codes):
            _stop(procs)
            return failed or 0
        if time.monotonic() > deadline:
            _stop(procs)
            raise subprocess.TimeoutExpired(argv, timeout)
        time.sleep(0.05)


def _stop(procs: list) -> None:
    """Terminates the ranks still running (SIGTERM, then SIGKILL after 5 s) and reaps them all."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
