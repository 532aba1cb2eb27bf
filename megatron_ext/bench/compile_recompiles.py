"""Benchmark: torch.compile graphs compiled after the first step, with and without pad-to-seq-len.

What users run: megatron_ext's ``PackedDataset`` (the embedded corpus, best-fit packing, seq_length
256) feeding Megatron's real ``GPTModel`` compiled with ``torch.compile``, one pack per micro-batch.
Without ``--pad-to-seq-len`` each pack is padded to the next multiple of 16, so a shorter pack has a
new shape; with it every pack is exactly 256 long. Counted: dynamo graphs compiled after step 1
(0 = no recompilation).
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from megatron_ext.bench.registry import BenchResult, register_benchmark

SEQ_LENGTH, MULTIPLE = 256, 16
#: ``quick`` -> (packs fed per setting, transformer layers, dynamic settings, backend). The 6th
#: pack of the corpus's best-fit plan is its first shorter one, so 6 packs see a new length.
SETTINGS = {
    True: (6, 1, ("False",), "eager"),
    False: (16, 2, ("False", "None"), "aot_eager"),
}


def _child(
    seq: int, multiple: int, num_batches: int, num_layers: int, dynamics: list[str], backend: str
) -> dict:
    """Inside the subprocess: packs from a real PackedDataset through a compiled GPTModel."""
    import numpy as np
    import torch

    from megatron_ext.data.indexed_writer import write_documents
    from megatron_ext.training.corpus import corpus_documents

    _init_one_rank()
    torch._dynamo.config.cache_size_limit = 64
    tmp = tempfile.mkdtemp(prefix="megatron_ext_compile_bench_")
    prefix = os.path.join(tmp, "corpus")
    write_documents(prefix, list(corpus_documents()), np.int32)
    out: dict = {}
    for pad_to_seq_len in (False, True):
        batches = _packs(prefix, tmp, seq, multiple, num_batches, pad_to_seq_len)
        key = "pad_to_seq_len" if pad_to_seq_len else "pad_to_multiple"
        out[key] = {"lengths": [int(b["tokens"].shape[1]) for b in batches]}
        # dynamic=False is what static-shape consumers (CUDA graphs, JIT GEMM kernels such as
        # DeepGEMM) effectively need; None is torch.compile's default (after a second distinct
        # length it recompiles once with a symbolic length).
        for dynamic in dynamics:  # "False" or "None"
            out[key][f"dynamic={dynamic}"] = _compiled_steps(
                batches, seq, num_layers, dynamic, backend
            )
    return out


def _init_one_rank() -> None:
    """CPU mode and a one-rank gloo process group with Megatron's parallel state and seeds."""
    import torch

    from megatron_ext.cpu.model_stack import enable_cpu_mode

    enable_cpu_mode()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0, force_reset_rng=True)


def _packs(
    prefix: str, tmp: str, seq: int, multiple: int, num_batches: int, pad_to_seq_len: bool
) -> list[dict]:
    """The first ``num_batches`` packs of a PackedDataset over ``prefix``, one per micro-batch
    (without --pad-to-seq-len packs of different lengths cannot be stacked)."""
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.tokenizers import MegatronTokenizer

    from megatron_ext.data.packed_dataset import PackedDataset, PackedDatasetConfig
    from megatron_ext.training.corpus import VOCAB_SIZE

    tokenizer = MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null-text"}, vocab_size=VOCAB_SIZE
    )
    config = PackedDatasetConfig(
        random_seed=1,
        sequence_length=seq,
        blend=([prefix], None),
        split="100,0,0",
        path_to_cache=os.path.join(tmp, "cache"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        pad_to_seq_len=pad_to_seq_len,
        pad_to_multiple_of=multiple,
    )
    builder = BlendedMegatronDatasetBuilder(
        PackedDataset, [num_batches, 0, 0], lambda: True, config
    )
    train = builder.build()[0]
    return [torch.utils.data.default_collate([train[i]]) for i in range(num_batches)]


def _compiled_steps(
    batches: list[dict], seq: int, num_layers: int, dynamic: str, backend: str
) -> dict:
    """Forward + backward of each batch through a freshly compiled GPTModel: the dynamo graphs
    compiled so far after each step, and the seconds of all steps."""
    import torch
    from torch._dynamo.utils import counters

    from megatron_ext.data.batch import gpt_forward_kwargs, masked_mean_loss
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config
    from megatron_ext.training.corpus import VOCAB_SIZE

    torch.manual_seed(0)
    # No MoE layers: an MoE layer's expert groups have data-dependent sizes (Megatron reads
    # tokens_per_expert on the host), so its graphs would recompile as the routing changes
    # whatever the pack length, hiding the effect measured here.
    cfg = tiny_moe_config(num_moe_experts=None, num_layers=num_layers)
    model = build_tiny_gpt(cfg, vocab_size=VOCAB_SIZE, max_seq_len=seq)
    # One eager step first: Megatron creates some state lazily on the first forward (rotary
    # cache, scratch buffers); compiling over that would count its one-off recompile against
    # whichever setting happens to run first.
    masked_mean_loss(model(**gpt_forward_kwargs(batches[0])), batches[0]["loss_mask"])
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend, dynamic={"False": False}.get(dynamic))
    graphs, start = [], time.perf_counter()
    for batch in batches:
        output = compiled(**gpt_forward_kwargs(batch))
        masked_mean_loss(output, batch["loss_mask"]).backward()
        graphs.append(int(counters["stats"]["unique_graphs"]))
    return {"graphs_per_step": graphs, "seconds": time.perf_counter() - start}


def _run_child(quick: bool) -> dict:
    """:func:`_child`'s figures, from a subprocess."""
    # A subprocess: the test and CLI environment disables dynamo (TORCHDYNAMO_DISABLE=1), and the
    # child needs its own one-rank process group.
    num_batches, num_layers, dynamics, backend = SETTINGS[quick]
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    args = [str(SEQ_LENGTH), str(MULTIPLE), str(num_batches), str(num_layers), backend]
    args.append(",".join(dynamics))
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.bench.compile_recompiles", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"compile benchmark child failed:\n{proc.stderr[-3000:]}")
    found = json.loads(lines[-1][len("RESULT ") :])
    return {"backend": backend, "num_layers": num_layers, **found}


@register_benchmark("compile_recompiles")
def compile_recompiles(quick: bool) -> BenchResult:
    """Graphs compiled after step 1: packs padded to a multiple of 16 vs to seq_length."""
    result = _run_child(quick)
    rows = []
    for key, label in (
        ("pad_to_multiple", f"pad to multiple of {MULTIPLE}"),
        ("pad_to_seq_len", "pad to seq_len (--pad-to-seq-len)"),
    ):
        r = result[key]
        static, default = r["dynamic=False"], r.get("dynamic=None")
        rows.append(
            [
                label,
                len(set(r["lengths"])),
                static["graphs_per_step"][0],
                static["graphs_per_step"][-1] - static["graphs_per_step"][0],
                "-"
                if default is None
                else default["graphs_per_step"][-1] - default["graphs_per_step"][0],
                static["seconds"],
                "-" if default is None else default["seconds"],
            ]
        )
    batches = SETTINGS[quick][0]
    return BenchResult(
        title=(
            f"torch.compile graphs after step 1, {batches} packs of the real PackedDataset into a "
            f"compiled Megatron GPTModel ({result['num_layers']} layer(s), CPU, backend "
            f"{result['backend']})"
        ),
        columns=[
            "pack length",
            "distinct lengths",
            "graphs in step 1",
            "new graphs after step 1, dynamic=False",
            "new graphs after step 1, dynamic=None",
            "seconds dynamic=False",
            "seconds dynamic=None",
        ],
        rows=rows,
        notes=(
            "The same packs (PackedDataset, best-fit, seq_length 256, one pack per micro-batch) "
            "feed both rows; only the pad target differs. Forward and backward through "
            "gpt_forward_kwargs (per-document causal mask) and a masked loss. Megatron's GPTModel "
            "without MoE layers: MoE expert groups have data-dependent sizes and recompile with "
            "the routing whatever the pack length. --quick: 6 packs, 1 layer, dynamic=False only, "
            "the eager backend (the same dynamo guards and recompile decisions, no AOT tracing); "
            "the full run: 16 packs, 2 layers, aot_eager (forward and backward graphs)."
        ),
        extra=result,
    )


if __name__ == "__main__":
    seq_, multiple_, num_batches_, num_layers_, backend_, dynamics_ = sys.argv[1:7]
    found = _child(
        int(seq_),
        int(multiple_),
        int(num_batches_),
        int(num_layers_),
        dynamics_.split(","),
        backend_,
    )
    print("RESULT " + json.dumps(found))
