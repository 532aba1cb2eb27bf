"""Timing benchmark variants in interleaved rounds and pairing their times round by round.

A shared machine drifts (other jobs, clocks, thermal): timing one variant after another reports
the drift as a difference. :func:`interleaved_rounds` runs every variant in every round, in
:func:`~megatron_ext.bench.rounds.round_order`'s balanced order, and :func:`paired_ratio` divides
the two variants' times within each round before taking the median, so a slowdown between rounds
moves both sides of each ratio alike (ms, the machine 10 % slower each round)::

                         round 0   round 1   round 2
    native                1.00      1.10      1.21
    ours                  1.01      1.111     1.2221
    ours / native         1.01      1.01      1.01     paired: median 1.01, min 1.01, max 1.01

:func:`synchronized_clock` is the clock to pass on a GPU (kernels run asynchronously).
"""

import statistics
import time
from collections.abc import Callable

import torch

from megatron_ext.bench.rounds import round_order


def interleaved_rounds(
    variants: dict[str, Callable[[], None]],
    rounds: int,
    clock: Callable[[], float] = time.thread_time,
    inner: int = 1,
) -> dict[str, list[float]]:
    """Times every variant in every round (in :func:`~megatron_ext.bench.rounds.round_order`'s
    order) after one warm-up pass; a round runs its order ``inner`` times over and keeps each
    variant's fastest call.

    Args:
        variants: ``{name: fn}``.
        rounds: Rounds timed.
        clock: Seconds; by default this thread's CPU time, which a shared machine's other jobs
            do not inflate (with one intra-op thread every op runs on the calling thread).
        inner: Passes per round.

    Returns:
        ``{name: [ms of round 0, ms of round 1, ...]}``: entry ``r`` of two variants is a pair.
    """
    names = list(variants)
    for name in names:
        variants[name]()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        best = dict.fromkeys(names, float("inf"))
        # The fastest of `inner` calls: a burst of other work on a shared machine during one call
        # does not decide the round.
        for _ in range(inner):
            for name in round_order(names, r):
                start = clock()
                variants[name]()
                best[name] = min(best[name], (clock() - start) * 1e3)
        for name in names:
            times[name].append(best[name])
    return times


def paired_ratio(times: dict[str, list[float]], name: str, base: str) -> dict[str, float]:
    """Median, min and max over rounds of ``times[name][r] / times[base][r]``."""
    ratios = [a / b for a, b in zip(times[name], times[base], strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def synchronized_clock() -> float:
    """Wall seconds after the GPU has finished its queued work."""
    # A GPU runs kernels asynchronously, and the host thread's CPU time does not see them.
    torch.cuda.synchronize()
    return time.perf_counter()
