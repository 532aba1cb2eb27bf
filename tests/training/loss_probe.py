"""Runs ``megatron_ext.pretrain_gpt`` and prints every training micro-batch's loss terms as the
loss function computed them (tests/training/test_loss_log.py), apart from Megatron's logging.

python -m tests.training.loss_probe <pretrain_gpt flags>

Each rank writes one line per micro-batch, ``loss probe: iteration I sum S tokens N``: the sum of
the masked per-token losses and the token count ``loss_func`` hands Megatron. An iteration's own
``lm loss`` is the sum of S over every rank and micro-batch divided by the sum of N.
"""

import sys

import torch

from megatron_ext.training import forward_step


def main() -> int:
    original = forward_step.loss_func

    def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
        loss, num_tokens, report = original(loss_mask, output_tensor)
        if torch.is_grad_enabled():  # training micro-batches (evaluation runs under no_grad)
            from megatron.training import get_args

            iteration = get_args().curr_iteration + 1  # the number Megatron's log line prints
            # One write, newline included: the ranks share one output stream.
            sys.stdout.write(
                f"loss probe: iteration {iteration} sum {loss.item()!r} tokens {int(num_tokens)}\n"
            )
            sys.stdout.flush()
        return loss, num_tokens, report

    forward_step.loss_func = loss_func
    from megatron_ext.pretrain_gpt import main as pretrain_main

    return pretrain_main()


if __name__ == "__main__":
    sys.exit(main())
