"""Ranks for tests/rehearse/test_local_launch.py: ``python -m tests.testing.launch_probe MODE``.

``pass``: every rank joins a gloo group, meets the others in a barrier and prints its rank, a draw
of numpy's global random state, and whether Megatron was imported before it started (a rank forked
from the preloaded server) with the start time Megatron's training module holds.
``fail DIR``: rank 1 exits (code 3) before joining, as a rank that dies at import or argument
parsing, so rank 0 waits for it in the rendezvous (30 minutes by default) until it is stopped. Rank 1
fails only once rank 0 has said it is joining (a file in DIR), so the order does not depend on which
interpreter starts faster.
``raise``: every rank raises an uncaught exception.
``exit``: an interpreter's exit, step by step: an unflushed print, a line to stderr, a non-daemon
thread that prints later, an exit handler that prints, and ``SystemExit`` with a message.
"""

import atexit
import os
import sys
import threading
import time

PRELOADED = "megatron.training.training" in sys.modules

import numpy as np  # noqa: E402 - after the check above
import torch.distributed as dist  # noqa: E402


def _exit_steps() -> None:
    print("unflushed print")
    sys.stderr.write("a line to stderr\n")
    atexit.register(lambda: print("exit handler ran"))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
    raise SystemExit("exit message")


if __name__ == "__main__":
    mode, rank = sys.argv[1], int(os.environ["RANK"])
    if mode == "exit":
        _exit_steps()
    if mode == "fail" and rank == 1:
        joining = os.path.join(sys.argv[2], "rank0_joining")
        deadline = time.monotonic() + 60
        while not os.path.exists(joining) and time.monotonic() < deadline:
            time.sleep(0.01)
        raise SystemExit(3)
    if mode == "raise":
        raise ValueError(f"rank {rank} raised")
    print(f"rank {rank} joining", flush=True)
    if mode == "fail":
        open(os.path.join(sys.argv[2], "rank0_joining"), "x").close()
    dist.init_process_group("gloo")
    print(f"rank {rank} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']}", flush=True)
    print(f"rank {rank} numpy draw {np.random.randint(1 << 62)}", flush=True)
    if PRELOADED:
        start = sys.modules["megatron.training.training"]._TRAIN_START_TIME
        print(f"rank {rank} preloaded, Megatron's start time {start!r}", flush=True)
    dist.barrier()
    print(f"rank {rank} passed the barrier", flush=True)
    dist.destroy_process_group()
