"""Tier: pure (the op counter) and one gloo rank (Megatron's real dispatchers, EP=1).

The alignment benchmark's 'ops/trip' columns: ATen calls that do work in one dispatch + combine, the
kernel launches a GPU would make. The counter leaves views and bare allocations out; the counts come
from Megatron's real dispatchers beside ours.
"""

import torch

from megatron_ext.bench.alignment import OpCounter
from megatron_ext.testing import run_distributed


def test_op_counter_counts_work_not_views_or_allocations():
    x = torch.randn(4, 4)
    with OpCounter() as counter:
        x.view(-1), x.t(), x[1:], x.select(0, 2), x.expand(2, 4, 4)  # views: no work
        torch.empty(3), x.new_empty(5)  # bare allocations: no kernel
        y = x + 1  # out of place
        y.mul_(2)  # in place
        y.sum()  # a reduction
    assert counter.count == 3
    with counter:  # re-entered: keeps counting
        x.clone()
    assert counter.count == 4


def _trip_ops(num_tokens: int) -> dict:
    from megatron_ext.bench import alignment as b

    counts = {}
    for dispatcher in b.DISPATCHERS:
        stock, ours = b._build(dispatcher, 64, False), b._build(dispatcher, 64, True)
        x = torch.randn(num_tokens, 1, 64)
        with torch.no_grad():
            probs, routing_map = stock.route(x)
        variants = {"unaligned": b._Variant(stock, None)}
        variants.update({p: b._Variant(ours, p) for p in b.PRECISIONS})
        if dispatcher == "alltoall":
            variants["router pad"] = b._Variant(stock, "fp8", router_padding=True)
        for name, v in variants.items():
            v.count_ops(x, probs, routing_map)  # first trip: builds the shared buffers
            counts[dispatcher, name] = v.count_ops(x, probs, routing_map)
    return counts


def _small_and_large() -> tuple[dict, dict]:
    return _trip_ops(48), _trip_ops(1024)


def test_ops_per_trip_of_megatrons_dispatchers_and_ours():
    small, large = run_distributed(_small_and_large, 1, ep=1, timeout=120)[0]
    for counts in (small, large):
        assert all(n > 5 for n in counts.values()), counts  # the counter saw the dispatchers
        for dispatcher in ("alltoall", "allgather"):
            ours = {counts[dispatcher, p] for p in ("fp8", "mxfp8", "nvfp4")}
            assert len(ours) == 1, counts  # one plan whatever the multiple
        # All-gather: the pad folded into the permute launches no more than Megatron's permute.
        assert counts["allgather", "fp8"] <= counts["allgather", "unaligned"], counts
        # All-to-all at EP=1: fewer than Megatron's router padding, which also aligns.
        assert counts["alltoall", "fp8"] < counts["alltoall", "router pad"], counts
    assert small == large  # no op count grows with the tokens (no data-dependent path here)
