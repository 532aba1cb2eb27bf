"""Tier: one gloo rank (Megatron's real dispatchers, EP=1).

The alignment benchmark's 'ops/trip' columns: ATen calls that do work in one dispatch + combine, the
kernel launches a GPU would make, counted by a variant's ``count_ops`` (the counter itself:
test_op_counter.py); the counts come from Megatron's real dispatchers beside ours.
"""

import torch

from megatron_ext.testing import run_distributed


def _trip_ops(num_tokens: int) -> dict:
    from megatron_ext.bench import dispatcher_variant as b

    counts = {}
    for dispatcher in b.DISPATCHERS:
        stock, ours = b.build_layer(dispatcher, 64, False), b.build_layer(dispatcher, 64, True)
        x = torch.randn(num_tokens, 1, 64)
        with torch.no_grad():
            probs, routing_map = stock.route(x)
        variants = {"unaligned": b.Variant(stock, None)}
        variants.update({p: b.Variant(ours, p) for p in b.PRECISIONS})
        if dispatcher == "alltoall":
            variants["router pad"] = b.Variant(stock, "fp8", router_padding=True)
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
