"""Launches ``python -m megatron_ext.pretrain_gpt --cpu`` under torchrun and reads what the loop logged.

For tests and the demo: Megatron's real ``pretrain`` runs in fresh processes (2 gloo ranks by default),
exactly as a user's launch would, and the returned :class:`LoopRun` parses Megatron's iteration lines
(``lm loss``, ``load_balancing_loss``, ...) and megatron_ext's expert-load lines from the output.

Example::

    run = launch([*TINY_MOE_ARGS, "--data-path", prefix, "--train-iters", "4"])
    run.check()                       # raises with the log tail if the launch failed
    run.losses                        # {1: 5.97, 2: 5.89, ...}
"""

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: A tiny MoE GPT (2 layers, 8 experts, top-2, EP=2 over 2 ranks) with local modules, for CPU runs.
TINY_MOE_ARGS: tuple[str, ...] = (
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "128", "--max-position-embeddings", "128",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
    "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--expert-model-parallel-size", "2",
    "--transformer-impl", "local", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
    "--lr-decay-style", "constant", "--tokenizer-type", "NullTokenizer", "--vocab-size", "257",
    "--split", "100,0,0", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
    "--seed", "7", "--cpu",
)  # fmt: skip

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
# A field name may end in a parenthesised unit: "elapsed time per iteration (ms)".
_FIELD = re.compile(r"([A-Za-z_ ]+?(?: \([^()|:]*\))?):\s+([-+0-9.eE]+|nan|inf) \|")


def free_port() -> int:
    """A TCP port nothing listens on right now (for torchrun's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LoopRun:
    """One finished launch: its command, exit status and output."""

    argv: list[str]
    returncode: int
    output: str
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
) -> LoopRun:
    """Runs ``torchrun --nproc-per-node nproc -m module *args`` and returns what it printed
    (``nproc=1``: the module directly, with torchrun's environment)."""
    port = str(free_port())
    full_env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    if nproc == 1:
        # One process: the environment torchrun would give it, without torchrun's agent process
        # (a second interpreter importing torch: seconds per launch on a 2-core machine).
        argv = [sys.executable, "-m", module, *args]
        full_env.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        )  # fmt: skip
    else:
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", port, "-m", module, *args,
        ]  # fmt: skip
    proc = subprocess.run(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
    )
    return LoopRun(argv=argv, returncode=proc.returncode, output=proc.stdout)
