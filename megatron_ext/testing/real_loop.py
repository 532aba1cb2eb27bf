"""The tiny MoE launch configuration the tests and the launch benchmark run, and the rehearsal's
launcher under the names the tests import (:mod:`megatron_ext.rehearse.local_launch`).

Example::

    run = launch([*TINY_MOE_TEST_ARGS, "--data-path", prefix, "--train-iters", "4"])
    run.check().losses                # {1: 5.97, 2: 5.89, ...}
"""

from megatron_ext.rehearse.local_launch import LoopRun, free_port, launch

__all__ = ["TINY_MOE_ARGS", "TINY_MOE_TEST_ARGS", "LoopRun", "free_port", "launch"]

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
#: :data:`TINY_MOE_ARGS` as the test suite launches it: each rank builds its batches itself
#: (``--num-workers 0``) instead of in Megatron's default 2 dataloader worker processes per rank,
#: which cost a tiny launch about 0.45 of its 2.3 CPU seconds. Same batches, same losses (checked
#: against a user's launch with the default workers: tests/training/test_startup.py); the demo, the
#: examples and the documented commands keep Megatron's default workers.
TINY_MOE_TEST_ARGS: tuple[str, ...] = (*TINY_MOE_ARGS, "--num-workers", "0")
