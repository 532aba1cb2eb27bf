"""Timing steps with and without the caching malloc setting, paired round by round.

The two sides run in two halves of one gloo world of ``2 * EP`` ranks: ranks ``[0, EP)`` keep
glibc's defaults, ranks ``[EP, 2 * EP)`` apply the setting. Every round runs every
``(step, allocator)`` pair once, in a balanced order, one half at a time::

    round 0:  [ours, glibc] [ours, caching] [unaligned, caching] [unaligned, glibc]
    round 1:  ...                                                 each pair once per round

"""

import resource
import statistics
import time
from collections.abc import Callable

import torch

from megatron_ext.bench.rounds import round_order
from megatron_ext.cpu.caching_malloc import keep_freed_memory

ALLOCATORS = ("glibc", "caching")


def enter_half(ep: int) -> str:
    """This rank's allocator (its half of the world), applied now; call before building anything."""
    from megatron.core import parallel_state

    # Two halves of one world, because the setting (cpu/caching_malloc.py) cannot be undone in a
    # process. Each half is one EP group: Megatron puts EP ranks next to each other.
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    assert world == 2 * ep, f"the halves need a world of 2 x EP ranks, got {world} at EP={ep}"
    half = rank // ep
    group = torch.distributed.get_process_group_ranks(
        parallel_state.get_expert_model_parallel_group()
    )
    assert all(r // ep == half for r in group), f"EP group {group} spans both halves"
    if ALLOCATORS[half] == "caching":
        keep_freed_memory()
    return ALLOCATORS[half]


def paired_rounds(steps: dict[str, Callable[[], float]], rounds: int, ep: int) -> dict:
    """Times every step on both halves, round by round; the same answer on every rank.

    Args:
        steps: ``{name: step}``; a step runs once and returns the seconds it measured (its own
            span), on every rank of its half alike (its collectives stay within the EP group).
        rounds: Rounds timed, after one untimed warm-up of every step on both halves.
        ep: EP size (ranks per half).

    Returns:
        ``{"ms": {allocator: {name: [ms per round]}}, "faults": {allocator: {name: [per step]}},
        "peak_rss_mib": {allocator: MiB}, "ratio": {name: (median, min, max) of caching /
        glibc}}``, times and faults from each half's first rank, peak RSS the half's largest.
    """
    half = ALLOCATORS[torch.distributed.get_rank() // ep]
    for step in steps.values():  # warm-up: first-call allocations, both halves at once
        step()
    torch.distributed.barrier()
    ms = {name: [] for name in steps}
    faults = {name: [] for name in steps}
    pairs = [(name, allocator) for name in steps for allocator in ALLOCATORS]
    for r in range(rounds):
        for name, allocator in round_order(pairs, r):
            if allocator == half:
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                ms[name].append(1e3 * steps[name]())
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            # One half at a time, the other waiting here: both sides of a round's ratio share the
            # machine's state.
            torch.distributed.barrier()
    # The process's whole life (imports, model and steps alike), in KiB on Linux.
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (half, ms, faults, peak_kib))
    out: dict = {"ms": {}, "faults": {}, "peak_rss_mib": {}, "ratio": {}}
    for allocator, times, counts, peak in gathered:
        out["ms"].setdefault(allocator, times)  # the half's first rank
        out["faults"].setdefault(allocator, counts)
        mib = peak / 1024
        out["peak_rss_mib"][allocator] = max(out["peak_rss_mib"].get(allocator, 0.0), mib)
    for name in steps:
        ratios = [
            c / g for c, g in zip(out["ms"]["caching"][name], out["ms"]["glibc"][name], strict=True)
        ]
        out["ratio"][name] = (statistics.median(ratios), min(ratios), max(ratios))
    return out


def layer_step(layer, x: torch.Tensor, **kwargs) -> Callable[[], float]:
    """A MoE layer's forward + backward on ``x`` (a fresh leaf each call) as a timed step."""

    def step() -> float:
        leaf = x.clone().requires_grad_(True)
        start = time.perf_counter()
        out, _ = layer(leaf, **kwargs)
        out.sum().backward()
        return time.perf_counter() - start

    return step
