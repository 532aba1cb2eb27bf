"""Ranks for tests/testing/test_real_loop_launch.py: ``python -m tests.testing.launch_probe MODE``.

``pass``: every rank joins a gloo group, meets the others in a barrier and prints its rank, and
whether Megatron was imported before it started (a rank forked from the preloaded server) with the
start time Megatron's training module holds.
``fail``: rank 1 exits (code 3) before joining, as a rank that dies at import or argument parsing,
so rank 0 waits for it in the rendezvous (30 minutes by default) until it is stopped.
``raise``: every rank raises an uncaught exception.
"""

import os
import sys

PRELOADED = "megatron.training.training" in sys.modules

import torch.distributed as dist  # noqa: E402 - after the check above

if __name__ == "__main__":
    mode, rank = sys.argv[1], int(os.environ["RANK"])
    if mode == "fail" and rank == 1:
        raise SystemExit(3)
    if mode == "raise":
        raise ValueError(f"rank {rank} raised")
    print(f"rank {rank} joining", flush=True)
    dist.init_process_group("gloo")
    print(f"rank {rank} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']}", flush=True)
    if PRELOADED:
        start = sys.modules["megatron.training.training"]._TRAIN_START_TIME
        print(f"rank {rank} preloaded, Megatron's start time {start!r}", flush=True)
    dist.barrier()
    print(f"rank {rank} passed the barrier", flush=True)
    dist.destroy_process_group()
