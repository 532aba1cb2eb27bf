"""Tier: gloo ranks (EP=1 and EP=2, one call each). megatron_ext's aligned dispatchers beside
Megatron's unaligned ones under Megatron MoE features the other dispatcher tests leave at their
defaults: shared experts, token dropping by expert capacity (both drop policies), group-limited
routing, sigmoid scores with a top-k scaling factor and expert bias, probs in the input dtype.

fp32 rehearsal of fp8 (alignment 16): the layer's output, the input gradient and every parameter
gradient equal the unaligned layer's bitwise, and the experts received groups aligned to 16 where
the unaligned groups were not. Tokens: 37 per rank, top-2 (top-4 for group-limited routing).
"""

import pytest

from megatron_ext.testing import run_distributed
from tests.moe.test_token_dispatcher import (
    NUM_TOKENS,
    _bitwise,
    build_layer,
    fwd_bwd,
    set_precision,
)

FEATURES = {
    "shared_experts": dict(moe_shared_expert_intermediate_size=64),
    "capacity_drop_probs": dict(moe_expert_capacity_factor=1.0),
    "capacity_drop_position": dict(
        moe_expert_capacity_factor=0.5, moe_token_drop_policy="position"
    ),
    "group_limited_top4": dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2),
    "sigmoid_scaled_expert_bias": dict(
        moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=2.5,
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none",
    ),
    "probs_in_input_dtype": dict(moe_router_dtype=None),
}


def _checks() -> dict:
    res = {}
    for name, overrides in FEATURES.items():
        for dispatcher in ("alltoall", "allgather"):
            ref, _, ref_groups = build_layer(dispatcher, aligned=False, **overrides)
            want = fwd_bwd(ref)
            ours, cfg, groups = build_layer(dispatcher, aligned=True, **overrides)
            ours.load_state_dict(ref.state_dict())
            set_precision(cfg, "fp8")
            ours.realign()  # the precision set after build, passed down
            got = fwd_bwd(ours)
            res[name, dispatcher] = {
                "bitwise": _bitwise(got, want),
                "nonzero": float(want[0].abs().max()),
                "real": ref_groups[-1],
                "groups": groups[-1],
                "shared_experts": ours.shared_experts is not None,
            }
    return res


@pytest.fixture(scope="module", params=[1, 2], ids=["ep1", "ep2"])
def results(request):
    ws = request.param
    return ws, run_distributed(_checks, ws, ep=ws)


def test_aligned_equals_unaligned_bitwise_under_megatron_features(results):
    ws, per_rank = results
    for key in per_rank[0]:
        name, dispatcher = key
        rows_received = 0  # over every rank: the routed pairs that reached an expert
        for res in per_rank:
            r = res[key]
            assert r["bitwise"], (key, r)
            assert r["nonzero"] > 1e-3  # a non-vacuous reference
            assert all(n % 16 == 0 for n in r["groups"]), (key, r)
            assert sum(r["groups"]) > sum(r["real"]), (key, r)  # pads really added
            assert r["shared_experts"] == (name == "shared_experts")
            rows_received += sum(r["real"])
        topk = FEATURES[name].get("moe_router_topk", 2)
        dropless = ws * NUM_TOKENS * topk
        # The capacity cases really dropped tokens; every other case is dropless.
        assert (rows_received < dropless) == name.startswith("capacity"), (key, rows_received)
