"""Ranks for tests/testing/test_real_loop_launch.py: ``python -m tests.testing.launch_probe MODE``.

``pass``: every rank joins a gloo group, meets the others in a barrier and prints its rank.
``fail``: rank 1 exits (code 3) before joining, as a rank that dies at import or argument parsing,
so rank 0 waits for it in the rendezvous (30 minutes by default) until it is stopped.
"""

import os
import sys

import torch.distributed as dist

if __name__ == "__main__":
    mode, rank = sys.argv[1], int(os.environ["RANK"])
    if mode == "fail" and rank == 1:
        raise SystemExit(3)
    print(f"rank {rank} joining", flush=True)
    dist.init_process_group("gloo")
    print(f"rank {rank} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']}", flush=True)
    dist.barrier()
    print(f"rank {rank} passed the barrier", flush=True)
    dist.destroy_process_group()
