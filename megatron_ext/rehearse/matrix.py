"""``megatron-ext rehearse``: a matrix of ``--cpu`` launch configurations, one line of result each.

Before booking GPUs, every configuration of a sweep can be tried on CPU: Megatron's real argument
validation, model build, data pipeline and training loop, at a tiny size. One ``torchrun`` per
configuration would spend most of its time importing Megatron; here one server imports it once and
each configuration runs in fresh ranks forked from it (:mod:`megatron_ext.rehearse.rank_server`, the
path the real-loop tests take), running the same ``python -m megatron_ext.pretrain_gpt`` code.

A configurations file holds one configuration per line, ``NAME: FLAGS`` (shell quoting; ``#``
comments and blank lines skipped); flags given after ``--`` on the command line go before every
line's, so a line's own flags win, and ``--example SCRIPT`` puts the flags a launch script passes
(read off its ``DRY_RUN=1`` path, :func:`example_flags`) before those::

    # sweep.txt
    alltoall: --moe-token-dispatcher-type alltoall
    allgather: --moe-token-dispatcher-type allgather
    bad ep: --expert-model-parallel-size 3

    $ megatron-ext rehearse sweep.txt -- --cpu --num-layers 2 ... --train-iters 3
    trained  alltoall   losses 5.972 5.801 5.629  step 140 ms  (9.8 s)
    trained  allgather  losses 5.972 5.801 5.629  step 150 ms  (4.1 s)
    refused  bad ep     megatron_ext: invalid arguments: ...

A launch that exits 0 without training (its ``--load`` checkpoint is already at ``--train-iters``)
is ``idle``, not trained; with ``--log-dir`` every configuration's output is kept, a stopped one's
(``--timeout``) up to where it was stopped.
"""

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launcher (and torch) only when a configuration runs: not for --help
    from megatron_ext.rehearse.local_launch import LoopRun

_REFUSAL = re.compile(r"megatron_ext: invalid arguments: .*")
_ERROR = re.compile(r"^(?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt)\b(?::.*)?$")
_STEP_FIELD = "elapsed time per iteration (ms)"
#: Megatron's checkpointing.load_checkpoint, on rank 0.
_LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)$", re.M)
_OWN_OPTIONS = ("--nproc", "--timeout", "--log-dir", "--example")


@dataclass(frozen=True)
class Configuration:
    """One line of a configurations file."""

    name: str
    flags: tuple[str, ...]


@dataclass
class Outcome:
    """What one configuration did: ``trained``, ``idle`` (exit 0, nothing trained), ``refused`` or
    ``crashed``, and how."""

    name: str
    status: str
    message: str = ""
    losses: dict[int, float] = field(default_factory=dict)
    step_ms: float | None = None
    seconds: float = 0.0

    def line(self, width: int) -> str:
        """The configuration's one-line report."""
        if self.status == "idle":
            return f"idle     {self.name:<{width}}  {self.message}  ({self.seconds:.1f} s)"
        if self.status != "trained":
            return f"{self.status:<8} {self.name:<{width}}  {self.message}"
        losses = " ".join(repr(v) for _, v in sorted(self.losses.items())) or "(none logged)"
        step = f"  step {self.step_ms:.0f} ms" if self.step_ms is not None else ""
        return f"trained  {self.name:<{width}}  losses {losses}{step}  ({self.seconds:.1f} s)"


def read_configurations(path: str) -> list[Configuration]:
    """Parses a configurations file (see the module docstring).

    Raises:
        ValueError: A line without ``NAME:``, unbalanced quoting or a repeated name, naming the
            file and line.
    """
    configurations: list[Configuration] = []
    for number, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        name, sep, flags = text.partition(":")
        where = f"{path}:{number}"
        if not sep or not name.strip() or name.strip().startswith("-"):
            raise ValueError(f"{where}: expected 'NAME: FLAGS', got {text!r}")
        try:
            parsed = tuple(shlex.split(flags, comments=True))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        if any(c.name == name.strip() for c in configurations):
            raise ValueError(f"{where}: configuration name {name.strip()!r} repeated")
        configurations.append(Configuration(name.strip(), parsed))
    if not configurations:
        raise ValueError(f"{path}: no configurations (lines 'NAME: FLAGS')")
    return configurations


def outcome_of(name: str, run: "LoopRun", seconds: float) -> Outcome:
    """Classifies a finished launch: trained, idle (exit 0 from a checkpoint already at
    ``--train-iters``), refused (its message) or crashed (its first error)."""
    lines = run.output.splitlines()
    if run.returncode == 0 and not run.iterations:
        loaded, train_iters = _LOADED.search(run.output), _last_int_flag(run.argv, "--train-iters")
        if loaded and train_iters is not None and int(loaded.group(1)) >= train_iters:
            message = (
                f"nothing trained: the checkpoint loaded is at iteration {loaded.group(1)}, "
                f"--train-iters is {train_iters}"
            )
            return Outcome(name, "idle", message, seconds=seconds)
    if run.returncode == 0:
        steps = [f[_STEP_FIELD] for f in run.iterations.values() if _STEP_FIELD in f]
        step = statistics.median(steps[1:] or steps) if steps else None  # the first one warms up
        return Outcome(name, "trained", losses=run.losses, step_ms=step, seconds=seconds)
    refusal = next((m.group(0) for line in lines if (m := _REFUSAL.search(line))), None)
    if run.returncode == 2 and refusal is not None:
        return Outcome(name, "refused", refusal, seconds=seconds)
    error = next((line.strip() for line in lines if _ERROR.match(line.strip())), None)
    if error is None:
        error = next((line.strip() for line in reversed(lines) if line.strip()), "no output")
    return Outcome(name, "crashed", f"exit {run.returncode}: {error}", seconds=seconds)


def _last_int_flag(argv: list[str], flag: str) -> int | None:
    """The value of the last ``flag N`` / ``flag=N`` in ``argv`` (argparse's last one wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


_FLAGS_SHIM = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then exec "$MEGATRON_EXT_PYTHON" "$@"; fi
printf '%s\\0' "$@" > "$MEGATRON_EXT_FLAGS"
"""


def example_flags(script: Path, env: dict[str, str], extra: list[str] = ()) -> list[str]:
    """The ``megatron_ext.pretrain_gpt`` flags a launch script passes, read off its ``DRY_RUN=1`` path.

    The script runs as written, with ``DRY_RUN=1`` and ``PYTHON`` a shim that records the arguments
    of the ``python -m megatron_ext.pretrain_gpt ... --dry-run`` it execs (and runs the real Python
    for the script's own ``-c`` checks): the flags, ``extra`` last, as the script would launch them.

    Raises:
        RuntimeError: The script failed or launched no ``-m megatron_ext.pretrain_gpt``.
    """
    with tempfile.TemporaryDirectory(prefix="megatron_ext_flags_") as tmp:
        shim, out = Path(tmp) / "python", Path(tmp) / "flags"
        shim.write_text(_FLAGS_SHIM)
        shim.chmod(0o755)
        shim_env = {
            **env, "DRY_RUN": "1", "PYTHON": str(shim), "MEGATRON_EXT_PYTHON": sys.executable,
            "MEGATRON_EXT_FLAGS": str(out),
        }  # fmt: skip
        proc = subprocess.run(
            ["bash", str(script), *extra], env=shim_env, capture_output=True, text=True
        )
        argv = out.read_text().split("\0")[:-1] if out.exists() else []
    if proc.returncode != 0 or argv[:2] != ["-m", "megatron_ext.pretrain_gpt"]:
        raise RuntimeError(
            f"{script}: no launch read off DRY_RUN=1 ({proc.returncode}): "
            f"{proc.stderr.strip()[-500:]}"
        )
    assert argv[-1] == "--dry-run", argv
    return argv[2:-1]


def rehearse(
    configurations: list[Configuration],
    common: list[str],
    *,
    nproc: int = 2,
    timeout: float = 600,
    log_dir: Path | None = None,
    echo: bool = True,
) -> list[Outcome]:
    """Runs each configuration as ``--cpu`` ranks forked from one preloaded server.

    Args:
        configurations: What to run, in order.
        common: Flags before every configuration's own (``--cpu`` is added when absent).
        nproc: Ranks per configuration.
        timeout: Seconds per configuration before it counts as crashed.
        log_dir: Where each configuration's whole output is written (``NAME.log``), if given.
        echo: Print each configuration's line as it finishes.
    """
    from megatron_ext.rehearse.local_launch import launch

    width = max(len(c.name) for c in configurations)
    outcomes = []
    for configuration in configurations:
        args = [*common, *configuration.flags]
        if "--cpu" not in args:
            args.append("--cpu")
        start = time.perf_counter()
        try:
            run = launch(args, nproc=nproc, timeout=timeout)
            output = run.output
        except subprocess.TimeoutExpired as err:  # launch attaches what the ranks printed
            run, stopped = None, f"megatron-ext rehearse: stopped after {timeout:g} s (--timeout)\n"
            output = (err.output or "") + stopped
        seconds = time.perf_counter() - start
        if run is None:
            outcome = Outcome(configuration.name, "crashed", f"timed out after {timeout:g} s")
        else:
            outcome = outcome_of(configuration.name, run, seconds)
        if log_dir is not None:
            safe = re.sub(r"[^\w.-]+", "_", configuration.name)
            (log_dir / f"{safe}.log").write_text(output)
        outcomes.append(outcome)
        if echo:
            print(outcome.line(width), flush=True)
    return outcomes


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``rehearse`` subcommand's arguments."""
    parser = sub.add_parser(
        "rehearse",
        help="check a matrix of launch configurations on CPU before booking GPUs",
        description=__doc__.split("\n\n")[0]
        + " Exits 1 if any configuration did not train (refused, crashed, stopped or idle).",
    )
    parser.add_argument("configs", metavar="FILE", help="configurations, one 'NAME: FLAGS' a line")
    parser.add_argument(
        "common", nargs=argparse.REMAINDER, metavar="-- FLAGS", help="flags for every line"
    )
    parser.add_argument("--nproc", type=int, default=2, help="ranks per configuration")
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds per configuration before it is stopped"
    )
    parser.add_argument("--log-dir", metavar="DIR", help="write each configuration's log here")
    parser.add_argument(
        "--example",
        metavar="SCRIPT",
        help="start every configuration from the flags this launch script passes (e.g. "
        "examples/cpu_demo.sh, read off its DRY_RUN=1 path with this environment)",
    )


def main(args: argparse.Namespace) -> int:
    """``megatron-ext rehearse``."""
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    configurations = read_configurations(args.configs)
    common = list(args.common)  # argparse has dropped the "--" before them
    if common[:1] == ["--"]:
        common = common[1:]
    misplaced = sorted(set(common) & set(_OWN_OPTIONS))
    if misplaced:
        raise ValueError(
            f"rehearse: {', '.join(misplaced)} after FILE would go to every launch: "
            "put rehearse's options before FILE"
        )
    if args.example:
        common = example_flags(Path(args.example), dict(os.environ)) + common
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    outcomes = rehearse(
        configurations, common, nproc=args.nproc, timeout=args.timeout, log_dir=log_dir
    )
    trained = sum(o.status == "trained" for o in outcomes)
    print(f"rehearse: {trained}/{len(outcomes)} configurations trained")
    return 0 if trained == len(outcomes) else 1
