"""Tier: gloo ranks (a 2-rank world: one half keeps glibc's malloc defaults, the other applies the
caching setting). The pairing the allocator columns rest on: each half ran its own setting, and the
setting shows where it should (faults of a step that allocates and frees a 64 MiB tensor)."""

from megatron_ext.testing import run_distributed
from megatron_ext.testing.distributed import shutdown_pools

#: Allocations per step. Under the caching setting the heap reaches its steady state only after
#: several 64 MiB allocations (torch's aligned blocks leave small live blocks between freed ones:
#: 7 to 9 faulting allocations measured here before reuse); 16 per step puts every timed round
#: after the warm-up step past that.
ALLOCATIONS = 16


def _allocating_step() -> float:
    import time

    import torch

    start = time.perf_counter()
    for _ in range(ALLOCATIONS):
        x = torch.ones(16 * 2**20)  # 64 MiB: a fresh mmap under glibc's defaults, every time
        del x
    return time.perf_counter() - start


def _pair(rounds: int) -> dict:
    from megatron_ext.bench.allocator_pair import enter_half, paired_rounds

    enter_half(ep=1)
    return paired_rounds({"alloc": _allocating_step}, rounds, ep=1)


def test_halves_pair_glibc_and_caching_round_by_round():
    shutdown_pools()  # the caching rank keeps its setting: fresh workers, shut down after
    try:
        results = run_distributed(_pair, 2, 4, ep=1, timeout=900)
    finally:
        shutdown_pools()
    assert results[0] == results[1]  # every rank gets the same answer
    out = results[0]
    assert len(out["ms"]["glibc"]["alloc"]) == len(out["ms"]["caching"]["alloc"]) == 4
    median, low, high = out["ratio"]["alloc"]
    assert low <= median <= high
    glibc, caching = (min(out["faults"][a]["alloc"]) for a in ("glibc", "caching"))
    # 16384 faults an allocation with 4 KiB pages under glibc's defaults; none once memory is kept.
    assert glibc >= 32 * ALLOCATIONS and 8 * caching <= glibc, (glibc, caching)
    assert set(out["peak_rss_mib"]) == {"glibc", "caching"}
    assert all(mib > 64 for mib in out["peak_rss_mib"].values())
