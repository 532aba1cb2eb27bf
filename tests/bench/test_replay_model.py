"""Tier: pure (the route comparison, hand-worked) and one gloo rank (the model and its RECORD).

The replay benchmark and the GPU check build one tiny MoE GPTModel, record its routes with
Megatron's own ``RouterReplay`` and compare routing maps with those routes. Router rows are
``s * B + b`` (the router's ``[S, B, H]`` input); megatron_ext's batch is ``[B, S, L, K]``.
"""

import torch

from megatron_ext.bench.replay_model import record_routes, replay_model, routes_match
from megatron_ext.testing import run_distributed


def test_routes_match_compares_chosen_experts_not_their_order():
    # 2 tokens, 3 experts, top-2: token 0 chose experts 0 and 2, token 1 chose 1 and 2.
    map_NE = torch.tensor([[True, False, True], [False, True, True]])
    assert routes_match([map_NE], [torch.tensor([[2, 0], [1, 2]])])  # top-k order is free
    assert not routes_match([map_NE], [torch.tensor([[0, 1], [1, 2]])])  # token 0 differs
    assert not routes_match([map_NE], [torch.tensor([[0, 2], [1, 2]])] * 2)  # a layer missing


def _record_and_compare(batch: int, seq: int, layers: int) -> dict:
    model, forward, routers = replay_model(batch, seq, layers)
    recorded, routes_BSLK = record_routes(routers, forward, batch, seq)
    maps: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, out: maps.append(out[1])) for r in routers]
    forward()  # native routing again: the same model and batch route the same way
    for hook in hooks:
        hook.remove()
    other = [m.clone() for m in maps]
    other[-1][0] = other[-1][0].roll(1)  # one token of the last layer on other experts
    _, forward_again, routers_again = replay_model(batch, seq, layers)  # a second, fresh build
    again, _ = record_routes(routers_again, forward_again, batch, seq)
    return {
        "recorded": recorded,
        "routes_BSLK": routes_BSLK,
        "same_forward_matches": routes_match(maps, recorded),
        "other_routing_matches": routes_match(other, recorded),
        "seeded": all(torch.equal(a, b) for a, b in zip(again, recorded, strict=True)),
    }


def test_recorded_routes_in_both_layouts_and_replayed_forward_matches():
    batch, seq, layers = 2, 8, 2
    r = run_distributed(_record_and_compare, 1, batch, seq, layers, timeout=120)[0]
    recorded, routes_BSLK = r["recorded"], r["routes_BSLK"]
    assert len(recorded) == layers
    assert all(t.dtype == torch.int64 and t.shape == (seq * batch, 2) for t in recorded)
    assert routes_BSLK.dtype == torch.uint8 and routes_BSLK.shape == (batch, seq, layers, 2)
    for b in range(batch):  # loop reference: router row s * B + b holds token (b, s)
        for s in range(seq):
            for layer in range(layers):
                assert torch.equal(routes_BSLK[b, s, layer].long(), recorded[layer][s * batch + b])
    assert r["same_forward_matches"] and not r["other_routing_matches"]
    assert r["seeded"]  # the benchmark's model and batch are the same on every call
