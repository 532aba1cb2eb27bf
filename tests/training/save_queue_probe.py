"""``python -m tests.training.save_queue_probe ARGS``: runs ``python -m megatron_ext.pretrain_gpt ARGS`` and,
at interpreter exit, prints how the results queue of Megatron's ``torch_dist`` writer was made: the
class of its manager's process (``ForkProcess`` / ``SpawnProcess``), or ``none`` (for
test_startup.py)."""

import atexit
import runpy
import sys

WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def _report() -> None:
    queue = getattr(sys.modules.get(WRITER), "_results_queue", None)
    made = "none" if queue is None else type(queue._manager._process).__name__
    print(f"results queue: {made}", flush=True)


if __name__ == "__main__":
    atexit.register(_report)
    sys.argv = ["megatron_ext.pretrain_gpt", *sys.argv[1:]]
    runpy.run_module("megatron_ext.pretrain_gpt", run_name="__main__", alter_sys=True)
