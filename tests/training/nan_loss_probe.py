"""``python -m tests.training.nan_loss_probe RANK ITERATION <pretrain_gpt flags>``: runs
``megatron_ext.pretrain_gpt`` with one rank's per-token losses made NaN (``* nan``) in every training
forward of one iteration (``ITERATION`` as Megatron's log line numbers it, its rerun included), for
tests/training/test_loss_guards.py. The loss function itself is megatron_ext's own, unchanged.
"""

import os
import sys

import torch

from megatron_ext.training import forward_step


def main() -> int:
    rank, iteration, flags = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    original = forward_step.forward_step

    def poisoned(data_iterator, model):  # noqa: ANN001, ANN202 (Megatron's forward_step_func)
        from megatron.training import get_args

        output, loss_fn = original(data_iterator, model)
        now = get_args().curr_iteration + 1
        if torch.is_grad_enabled() and now == iteration and int(os.environ["RANK"]) == rank:
            output = output * float("nan")
        return output, loss_fn

    forward_step.forward_step = poisoned  # read by the entry when it starts Megatron's pretrain
    sys.argv = ["megatron_ext.pretrain_gpt", *flags]
    from megatron_ext.pretrain_gpt import main as pretrain_main

    return pretrain_main()


if __name__ == "__main__":
    sys.exit(main())
