"""Tier: pure (the routing helper) and one gloo rank (Megatron's real dispatchers, EP=1).

The alignment benchmark's 'no pad needed' column times ours beside Megatron's on a routing whose
expert counts are already multiples of the alignment, so that ours' own cost shows without any
pad row's data in it. These tests check that routing: every count a multiple, each token keeping
its top-k experts distinct and its own probabilities, and ours adding no pad row on it.
"""

import pytest
import torch

from megatron_ext.bench.alignment_rows import no_pad_inputs
from megatron_ext.testing import run_distributed


def _routing(num_tokens: int, num_experts: int = 8, topk: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    top = scores.topk(topk, dim=1)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map.scatter_(1, top.indices, True)
    probs = torch.zeros(num_tokens, num_experts).scatter_(1, top.indices, top.values.softmax(1))
    return probs, routing_map


@pytest.mark.parametrize(("num_tokens", "expected_align"), [(48, 32), (1024, 128), (8192, 128)])
def test_no_pad_routing_counts_are_multiples_and_tokens_keep_their_probs(
    num_tokens, expected_align
):
    probs, routing_map = _routing(num_tokens)
    align, new_probs, new_map = no_pad_inputs(probs, routing_map, [16, 32, 128])
    assert align == expected_align
    counts = new_map.sum(0)
    assert bool((counts % align == 0).all()) and int(counts.sum()) == 2 * num_tokens
    assert bool((counts > 0).any())
    assert bool((new_map.sum(1) == 2).all())  # each token still has two distinct experts
    assert bool((new_probs[~new_map] == 0).all())
    # Each token's probabilities are its own, only on other experts.
    old = probs.masked_select(routing_map).view(num_tokens, 2).sort(1).values
    new = new_probs.masked_select(new_map).view(num_tokens, 2).sort(1).values
    assert torch.equal(old, new)


def test_no_pad_routing_refused_when_no_multiple_fits():
    probs, routing_map = _routing(10)  # 20 routed pairs: no group of 16 distinct tokens
    assert no_pad_inputs(probs, routing_map, [16]) is None
    align, _, new_map = no_pad_inputs(probs, routing_map, [128, 4])  # falls back to 4
    assert align == 4 and bool((new_map.sum(0) % 4 == 0).all())


def _groups_on_no_pad_routing() -> dict:
    from megatron_ext.bench import dispatcher_variant as b

    round_probs, round_map = _routing(48)
    x = torch.randn(48, 1, 64)
    _, probs, routing_map = no_pad_inputs(round_probs, round_map, [16, 32])
    groups = {}
    for dispatcher in b.DISPATCHERS:
        stock, ours = b.build_layer(dispatcher, 64, False), b.build_layer(dispatcher, 64, True)
        variants = {"unaligned": b.Variant(stock, None), "fp8": b.Variant(ours, "fp8")}
        for name, v in variants.items():
            v.run(x, probs, routing_map, 1)
            groups[dispatcher, name] = [int(n) for n in v.groups]
        variants["fp8"].run(x, round_probs, round_map, 1)  # the round's routing: pads
        groups[dispatcher, "fp8 round"] = [int(n) for n in variants["fp8"].groups]
    return groups


def test_ours_adds_no_pad_row_on_the_no_pad_routing():
    groups = run_distributed(_groups_on_no_pad_routing, 1, ep=1, timeout=120)[0]
    for dispatcher in ("alltoall", "allgather"):
        unaligned, ours = groups[dispatcher, "unaligned"], groups[dispatcher, "fp8"]
        assert sum(unaligned) == 96 and ours == unaligned, groups
        assert sum(groups[dispatcher, "fp8 round"]) > 96, groups  # elsewhere ours does pad
