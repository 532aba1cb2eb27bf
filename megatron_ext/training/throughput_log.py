"""The per-interval token-throughput line of ``megatron_ext.pretrain_gpt`` (Megatron glue of
:mod:`megatron_ext.training.token_throughput`; docs/data.md, "Real-token throughput in the log")."""

import time
from typing import Any

import torch

from megatron_ext.training import run_state
from megatron_ext.training.token_throughput import (
    TokenCounts,
    format_line,
    micro_batch_counts,
    rates,
)


def count_micro_batch(args: Any, host_batch: dict[str, torch.Tensor]) -> None:
    """Adds one training micro-batch's host counts to the interval."""
    run = run_state.state(args)
    # The first interval runs from the first training forward: it includes the warm-up.
    if run.token_counts is None:
        run.token_counts, run.token_clock = TokenCounts(), time.perf_counter()
    counts = micro_batch_counts(host_batch)
    if counts is not None:
        run.token_counts.add(*counts)


def log_token_throughput(args: Any, iteration: int) -> dict[str, Any] | None:
    """After a log iteration (0-based ``iteration``): the interval's record, printed on the first
    rank and kept for the expert-load JSON line. Every rank of a data-parallel group calls it."""
    run = run_state.state(args)
    if run.token_counts is None or (iteration + 1) % args.log_interval:
        return None
    from megatron.core import parallel_state

    now = time.perf_counter()
    seconds, run.token_clock = max(now - run.token_clock, 1e-9), now
    counts, run.token_counts = run.token_counts, TokenCounts()
    data_parallel = parallel_state.get_data_parallel_world_size()
    exact = data_parallel == 1 or args.use_gloo_process_groups
    # Summed over the data-parallel ranks only (TP, CP and PP ranks of one DP rank hold the same
    # samples), on Megatron's gloo group: a host all-reduce of two ints, nothing read off the device.
    # Without gloo groups: this rank's share times the DP size, marked as an estimate.
    if data_parallel > 1 and exact:
        summed = torch.tensor([counts.tokens, counts.real_tokens], dtype=torch.int64)
        torch.distributed.all_reduce(summed, group=parallel_state.get_data_parallel_group_gloo())
        counts = TokenCounts(tokens=int(summed[0]), real_tokens=int(summed[1]))
    elif not exact:
        counts = TokenCounts(
            tokens=counts.tokens * data_parallel, real_tokens=counts.real_tokens * data_parallel
        )
    record = {**rates(counts, seconds), "token_counts_exact": exact}
    # A middle pipeline stage reads no batch: it has no counts to give (its JSON line carries none).
    run.last_throughput = record if counts.tokens else None
    first = (
        parallel_state.get_data_parallel_rank() == 0
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_context_parallel_rank() == 0
        and parallel_state.get_pipeline_model_parallel_rank() == 0
    )
    if first:
        suffix = "" if exact else " (estimated: this rank's share x data-parallel size)"
        print(f"{format_line(record)} (iteration {iteration + 1}){suffix}", flush=True)
    return record
