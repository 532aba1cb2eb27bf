"""Benchmark: torch.compile recompilations over 20 packed batches, with and without pad-to-seq-len.

Rows are RL-style: one document (rollout) of the embedded corpus per row, cut at seq_length 256; without
``--pad-to-seq-len`` each batch is padded to the next multiple of 16, so its length varies; with it every batch is exactly 256 long.
A small embedding + MLP module is compiled on CPU and fed the 20 batches. Counted: graphs compiled by
dynamo (1 = no recompilation). ``dynamic=False`` is what static-shape consumers (CUDA graphs, JIT GEMM
kernels such as DeepGEMM) effectively need; ``dynamic=None`` is torch.compile's default (it recompiles once
with symbolic shapes after the second distinct length). Runs in a subprocess because the test and CLI
environment disables dynamo (TORCHDYNAMO_DISABLE=1).
"""

import json
import os
import subprocess
import sys

from megatron_ext.bench.registry import BenchResult, register_benchmark

SEQ_LENGTH, MULTIPLE, NUM_BATCHES = 256, 16, 20

_CHILD = r"""
import json, sys, time
import numpy as np, torch
from torch._dynamo.utils import counters
from megatron_ext.data.padding import padded_lengths
from megatron_ext.training.corpus import corpus_documents

seq, multiple, n, backend = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
real = np.minimum([d.size for d in corpus_documents()[:n]], seq)  # one rollout per row
torch._dynamo.config.cache_size_limit = 64
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 64), torch.nn.GELU(),
                            torch.nn.Linear(64, 32))
out = {"distinct_lengths": {}}
for pad_to_seq_len in (False, True):
    lengths = padded_lengths(real, seq_length=seq, pad_to_seq_len=pad_to_seq_len, pad_to_multiple_of=multiple)
    key = "pad_to_seq_len" if pad_to_seq_len else "pad_to_multiple"
    out["distinct_lengths"][key] = int(np.unique(lengths).size)
    for dynamic in (False, None):
        torch._dynamo.reset(); counters.clear()
        compiled = torch.compile(model, backend=backend, dynamic=dynamic)
        start = time.perf_counter()
        for length in lengths:
            compiled(torch.randint(0, 256, (2, int(length)))).sum()
        out[f"{key}/dynamic={dynamic}"] = {
            "graphs": int(counters["stats"]["unique_graphs"]), "seconds": time.perf_counter() - start}
print("RESULT " + json.dumps(out))
"""


def _run_child(backend: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(SEQ_LENGTH), str(MULTIPLE), str(NUM_BATCHES), backend],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"compile benchmark child failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


@register_benchmark("compile_recompiles")
def compile_recompiles(quick: bool) -> BenchResult:
    """Dynamo graphs compiled over 20 batches: pad to a multiple of 16 vs pad to seq_length."""
    backend = "aot_eager" if quick else "inductor"
    result = _run_child(backend)
    rows = []
    for key, label in (
        ("pad_to_multiple", f"pad to multiple of {MULTIPLE}"),
        ("pad_to_seq_len", "pad to seq_len"),
    ):
        static, default = result[f"{key}/dynamic=False"], result[f"{key}/dynamic=None"]
        rows.append(
            [
                label,
                result["distinct_lengths"][key],
                static["graphs"] - 1,
                default["graphs"] - 1,
                static["seconds"],
                default["seconds"],
            ]
        )
    return BenchResult(
        title=f"torch.compile recompilations over {NUM_BATCHES} packed batches (CPU, backend {backend})",
        columns=[
            "batch length",
            "distinct lengths",
            "recompiles dynamic=False",
            "recompiles dynamic=None",
            "seconds dynamic=False",
            "seconds dynamic=None",
        ],
        rows=rows,
        notes=(
            "Recompiles = dynamo graphs compiled - 1. The same 20 single-document rows of the embedded "
            "corpus (seq_length 256) feed both rows of this table; only the pad target differs. --quick uses the aot_eager "
            "backend (same dynamo guards and recompile decisions, no C++ codegen); the full run uses inductor."
        ),
        extra=result,
    )
