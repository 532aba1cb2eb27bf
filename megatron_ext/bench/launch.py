"""Benchmark: what a ``--cpu`` rehearsal costs beyond importing Megatron, as a user launches it.

A tiny 2-rank ``--cpu`` launch of 3 iterations (torchrun's agent, two ranks, Megatron's
initialization, training, exit) against ``python -c "import megatron.training.training"``, the floor
any launch pays: the median over rounds of ``launch / import`` within each round (near 1: a launch
that imported and did nothing else).
"""

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_ext.bench.registry import BenchResult, register_benchmark
from megatron_ext.bench.round_timing import paired_ratio
from megatron_ext.bench.rounds import round_order
from megatron_ext.testing.real_loop import TINY_MOE_ARGS, free_port

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 3
VARIANTS = ("launch", "import")
_COLUMNS = ["command", "min s", "median s", "ratio (median)", "ratio min", "ratio max"]


def _commands(prefix: str) -> dict[str, list[str]]:
    launch = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", "{port}", "-m", "megatron_ext.pretrain_gpt", *TINY_MOE_ARGS,
        "--data-path", prefix, "--train-iters", str(ITERATIONS),
    ]  # fmt: skip
    return {"launch": launch, "import": [sys.executable, "-c", "import megatron.training.training"]}


def _write_corpus(prefix: str) -> None:
    """The embedded corpus as Megatron token files at ``prefix`` (tools/preprocess_data.py)."""
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input",
         str(ROOT / "megatron_ext" / "assets" / "corpus.jsonl"), "--output-prefix", prefix,
         "--append-eod"],
        check=True, capture_output=True,
    )  # fmt: skip


def _children_cpu() -> float:
    """User + system CPU seconds of every finished child process (and theirs: torchrun's ranks)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one command; raises with its output's tail if it fails."""
    argv = [a.replace("{port}", str(free_port())) for a in argv]
    cpu = _children_cpu()
    start = time.perf_counter()
    proc = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )
    seconds = time.perf_counter() - start
    cpu = _children_cpu() - cpu
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise RuntimeError(f"launch benchmark: {argv[:4]}... failed ({proc.returncode}):\n{tail}")
    return seconds, cpu


@register_benchmark("launch")
def launch_overhead(quick: bool) -> BenchResult:
    """A tiny 2-rank ``--cpu`` launch of 3 iterations vs a bare Megatron import."""
    # Full runs: an even number of rounds, so each command runs first equally often; a quick one
    # (CI) times one pair.
    rounds = 1 if quick else 6
    # TORCHDYNAMO_DISABLE is removed, as a user's shell has it.
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    with tempfile.TemporaryDirectory(prefix="megatron_ext_launch_bench_") as tmp:
        prefix = str(Path(tmp) / "corpus_text_document")
        _write_corpus(prefix)
        commands = _commands(prefix)
        _timed(commands["import"], env)  # warm-up: the files both read are in the page cache
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for r in range(rounds):
            for name in round_order(list(VARIANTS), r):
                wall, used = _timed(commands[name], env)
                times[name].append(wall)
                cpu[name].append(used)
    return BenchResult(
        title="Launch overhead: a tiny 2-rank --cpu launch vs importing Megatron",
        columns=_COLUMNS,
        rows=_paired_rows(times),
        notes=(
            f"{rounds} interleaved rounds, wall time of fresh processes. `launch`: torchrun, 2 "
            f"ranks, the tiny MoE GPT (EP=2, local modules) with `--cpu`, {ITERATIONS} iterations "
            'on the embedded corpus. `import`: `python -c "import megatron.training.training"`. '
            "Ratio: launch / import within each round; median (min, max) over rounds."
        ),
        extra={"seconds": times, "cpu_seconds": cpu, "rounds": rounds},
        # Other jobs on a shared machine stretch wall times by however long they hold the cores,
        # but hardly the CPU seconds a command uses. It counts what the launch runs (the agent
        # and both ranks each import torch), not what it overlaps on idle cores.
        tables=[
            BenchResult(
                title="The same launches in CPU seconds",
                columns=_COLUMNS,
                rows=_paired_rows(cpu),
                notes="User + system CPU seconds of each command's process tree (torchrun's agent "
                "and both ranks), paired by round as above.",
            )
        ],
    )


def _paired_rows(seconds: dict[str, list[float]]) -> list[list[float | str]]:
    """One row per command: min and median seconds, and the launch's paired ratio to the import."""
    ratio = paired_ratio(seconds, "launch", "import")
    rows: list[list[float | str]] = [
        [name, min(seconds[name]), statistics.median(seconds[name])] for name in VARIANTS
    ]
    rows[0] += [ratio["median"], ratio["min"], ratio["max"]]
    rows[1] += [1.0, 1.0, 1.0]
    return rows
