"""Not a test module: the arguments the tests of ``python -m megatron_ext.pretrain_gpt`` share.

The tiny MoE model they launch (``BASE_ARGS``: 2 layers, top-2 of 8 experts, EP 2), route replay's
flags, and the entry's ``--dry-run`` in this process. The data they name is the ``data_prefix``
fixture of tests/training/conftest.py, written for this model.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NUM_LAYERS, TOPK, EXPERTS = 2, 2, 8

BASE_ARGS = [
    "--num-layers",
    str(NUM_LAYERS),
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "128",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--position-embedding-type",
    "rope",
    "--num-experts",
    str(EXPERTS),
    "--moe-router-topk",
    str(TOPK),
    "--moe-ffn-hidden-size",
    "64",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--moe-router-dtype",
    "fp32",
    "--expert-model-parallel-size",
    "2",
    "--transformer-impl",
    "local",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "4",
    "--lr",
    "1e-3",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "256",
    "--split",
    "100,0,0",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--no-gradient-accumulation-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion",
    "--no-persist-layer-norm",
    "--no-rope-fusion",
    "--seed",
    "7",
    "--use-cpu-initialization",
]


#: Packed data with route replay from the ``_routes`` sidecar next to ``data_prefix``.
REPLAY_ARGS = [
    "--pack-documents", "--pad-to-seq-len",
    "--route-replay-mode", "replay", "--route-data-suffix", "_routes",
]  # fmt: skip


def dry_run_main(argv: list[str], monkeypatch) -> int:
    """``python -m megatron_ext.pretrain_gpt <argv> --dry-run`` in this process (2 ranks' world)."""
    from megatron_ext.pretrain_gpt import main
    from megatron_ext.training import run_state

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", *BASE_ARGS, *argv, "--dry-run", "--verbose"])
    try:
        return main()
    finally:
        run_state.reset()
