"""Tier: pure (and Megatron's argument parser). ``--moe-pad-routing``: how ``auto`` resolves, what ``skip``
refuses at argument time, clearing pad routes, the pads-first slot rule and the host-side counts."""

import sys

import pytest
import torch

from megatron_ext.common.micro_batch import MicroBatchContext
from megatron_ext.moe.pad_routing import (
    PadRouting,
    clear_pad_routes,
    pads_first_keep,
    resolve_pad_routing,
)
from megatron_ext.testing import assert_no_host_sync
from tests.import_probe import imported_from

DROPLESS = dict(
    capacity_factor=None,
    pad_to_capacity=False,
    cuda_graph_over_moe=False,
    dispatcher="alltoall",
    router_padding=False,
)


def test_module_never_imports_megatron() -> None:
    assert imported_from(["megatron_ext.moe.pad_routing"], ["megatron"]) == []


@pytest.mark.parametrize(
    "change, auto",
    [
        ({}, "skip"),
        ({"dispatcher": "allgather"}, "skip"),
        ({"capacity_factor": 1.0}, "dispatch"),
        ({"capacity_factor": 1.0, "pad_to_capacity": True}, "dispatch"),
        ({"cuda_graph_over_moe": True}, "dispatch"),
        ({"dispatcher": "flex"}, "dispatch"),
        ({"router_padding": True}, "dispatch"),
        ({"gloo_expert_tp": True}, "dispatch"),
    ],
)
def test_auto_skips_only_where_nothing_needs_the_pads_rows(change: dict, auto: str) -> None:
    settings = {**DROPLESS, **change}
    mode, why = resolve_pad_routing("auto", **settings)
    assert mode == auto and why.startswith("auto")
    assert resolve_pad_routing("dispatch", **settings)[0] == "dispatch"


@pytest.mark.parametrize(
    "change, flag",
    [
        ({"capacity_factor": 1.0, "pad_to_capacity": True}, "--moe-pad-expert-input-to-capacity"),
        ({"cuda_graph_over_moe": True}, "--cuda-graph-impl"),
        ({"dispatcher": "flex"}, "--moe-token-dispatcher-type flex"),
        ({"router_padding": True}, "--moe-router-padding-for-quantization"),
        ({"gloo_expert_tp": True}, "--cpu and --expert-tensor-parallel-size"),
    ],
)
def test_skip_with_static_shapes_is_refused_naming_both_flags(change: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=f"--moe-pad-routing skip .*{flag}"):
        resolve_pad_routing("skip", **{**DROPLESS, **change})
    # Skip under a capacity factor (no capacity padding) is allowed: pads are dropped first anyway.
    assert resolve_pad_routing("skip", **{**DROPLESS, "capacity_factor": 1.0})[0] == "skip"


def _parse(argv: list[str]):
    from megatron.training.arguments import parse_args

    from megatron_ext.training.arguments import add_megatron_ext_args

    old, sys.argv = sys.argv, ["x", *argv]
    try:
        return parse_args(extra_args_provider=add_megatron_ext_args, ignore_unknown_args=True)
    finally:
        sys.argv = old


def test_flag_parses_and_refusals_reach_argument_time(capsys) -> None:
    from megatron_ext.training.arguments import configs_from_args
    from megatron_ext.training.feature_configs import MoEPadRoutingConfig

    moe = ["--num-experts", "8", "--moe-token-dispatcher-type", "alltoall"]
    cfg = configs_from_args(_parse(moe))[MoEPadRoutingConfig]
    assert cfg.moe_pad_routing == "auto" and cfg.resolve(_parse(moe))[0] == "skip"
    capacity = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
    with pytest.raises(ValueError, match="skip .*--moe-pad-expert-input-to-capacity"):
        configs_from_args(_parse([*moe, "--moe-pad-routing", "skip", *capacity]))
    graphs = ["--cuda-graph-impl", "transformer_engine"]
    with pytest.raises(ValueError, match="skip .*--cuda-graph-impl"):
        configs_from_args(_parse([*moe, "--moe-pad-routing", "skip", *graphs]))
    assert (
        configs_from_args(_parse([*moe, *capacity]))[MoEPadRoutingConfig].resolve(
            _parse([*moe, *capacity])
        )[0]
        == "dispatch"
    )
    with pytest.raises(SystemExit):  # argparse's choices: not a mode
        _parse([*moe, "--moe-pad-routing", "drop"])
    assert "--moe-pad-routing: invalid choice: 'drop'" in capsys.readouterr().err


def test_clear_pad_routes_hand_worked() -> None:
    # The module docstring's example: 4 tokens, 3 experts, top-1, tokens 2 and 3 are pads.
    routing_map = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 1, 0], [0, 0, 1]], dtype=torch.bool)
    probs = routing_map.float() * torch.tensor([[0.7], [0.6], [0.9], [0.8]])
    pad = torch.tensor([False, False, True, True])
    probs_out, map_out = assert_no_host_sync(clear_pad_routes, probs, routing_map, pad)
    assert map_out.tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 0]]
    assert torch.equal(probs_out[:2], probs[:2]) and not probs_out[2:].any()
    # The mask may come in the MoE layer's [S, B] layout: flattened in the router's order.
    sb = clear_pad_routes(probs, routing_map, pad.view(2, 2))[1]
    assert torch.equal(sb, map_out)


def test_pads_first_keep_is_sync_free_and_zero_tokens_safe() -> None:
    empty = torch.zeros(0, 4, dtype=torch.bool)
    kept = assert_no_host_sync(
        pads_first_keep,
        empty,
        empty,
        torch.zeros(0, 4),
        torch.zeros(0, dtype=torch.bool),
        2,
        "probs",
    )
    assert kept.shape == (0, 4)
    routing = torch.ones(3, 1, dtype=torch.bool)
    pad = torch.tensor([True, True, True])
    kept = assert_no_host_sync(
        pads_first_keep, torch.zeros_like(routing), routing, torch.ones(3, 1), pad, 2, "position"
    )
    assert kept[:, 0].tolist() == [True, True, False]  # one expert, all pads: the first two
    with pytest.raises(ValueError, match="--moe-token-drop-policy"):
        pads_first_keep(routing, routing, torch.ones(3, 1), pad, 2, "random")


def test_pad_routing_counts_per_micro_batch_and_for_recompute() -> None:
    """Counts are kept per micro-batch key of the run's context: a recompute in backward reads
    the count of the micro-batch the context says is in backward, after later forwards."""
    context = MicroBatchContext()
    routing = PadRouting("skip", micro_batches=context)
    mask_a = torch.tensor([[False, True], [False, True]])
    context.begin("a")
    with pytest.raises(ValueError, match="set_micro_batch"):
        routing.real_tokens(mask_a)
    routing.set_micro_batch(4, 2)
    assert routing.real_tokens(mask_a) == 2
    context.begin("b")  # the next micro-batch's forward ...
    routing.set_micro_batch(4, 3)
    mask_b = torch.zeros(2, 2, dtype=torch.bool)
    assert routing.real_tokens(mask_b) == 3
    context.enter_backward("a")  # ... then micro-batch a's recompute, in its backward
    assert routing.real_tokens(mask_a) == 2
    context.enter_backward("b")
    assert routing.real_tokens(mask_a) == 3
    context.enter_backward("never announced")
    with pytest.raises(ValueError, match="recomputed MoE layer runs micro-batch 'never announced'"):
        routing.real_tokens(mask_a)
    context.begin("c")
    with pytest.raises(ValueError, match="tokens"):
        routing.set_micro_batch(4, 1)
        routing.real_tokens(torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="not a count"):
        routing.set_micro_batch(4, 5)
    routing.clear()
    with pytest.raises(ValueError, match="set_micro_batch"):
        routing.real_tokens(mask_a)
    context.enter_backward("a")  # cleared: a's count is gone
    with pytest.raises(ValueError, match="no forward announced"):
        routing.real_tokens(mask_a)


def test_a_count_announced_for_an_earlier_micro_batch_is_not_the_current_one() -> None:
    context = MicroBatchContext()
    routing = PadRouting("skip", micro_batches=context)
    context.begin("a")
    routing.set_micro_batch(4, 2)
    context.begin("b")  # begun, nothing announced for it
    with pytest.raises(ValueError, match="set_micro_batch before every forward"):
        routing.real_tokens(torch.zeros(4, dtype=torch.bool))


def test_a_forward_nobody_announced_does_not_reuse_the_last_count() -> None:
    """Every MoE layer takes the announced count once per forward; a layer asking again is the
    next micro-batch's forward, whose count (here 1 real token, not 2) nobody announced."""
    routing = PadRouting("skip")
    routing.set_micro_batch(4, 2)
    mask_a = torch.tensor([[False, True], [False, True]])
    assert [routing.real_tokens(mask_a, layer) for layer in (1, 2)] == [2, 2]
    mask_b = torch.tensor([[False, True], [True, True]])  # the next micro-batch, unannounced
    with pytest.raises(ValueError, match="set_micro_batch before every forward"):
        routing.real_tokens(mask_b, 1)
    with pytest.raises(ValueError, match="set_micro_batch"):  # and for its later layers too
        routing.real_tokens(mask_b, 2)
    routing.set_micro_batch(4, 1)  # announced: counted again
    assert [routing.real_tokens(mask_b, layer) for layer in (1, 2)] == [1, 1]
    lenient = PadRouting("skip", required=False)
    lenient.set_micro_batch(4, 2)
    assert lenient.real_tokens(mask_a, 1) == 2
    with pytest.warns(UserWarning, match="routed like text"):
        assert lenient.real_tokens(mask_b, 1) is None  # auto: pads dispatched, not a stale count


def test_auto_without_an_announced_count_routes_pads_like_text_with_one_warning() -> None:
    routing = PadRouting("skip", required=False)
    mask = torch.zeros(4, dtype=torch.bool)
    with pytest.warns(UserWarning, match="routed like text"):
        assert routing.real_tokens(mask) is None
    assert routing.real_tokens(mask) is None  # warned once
    routing.set_micro_batch(4, 4)
    assert routing.real_tokens(mask) == 4


@pytest.mark.parametrize(
    "graphs, auto",
    [
        (["--cuda-graph-impl", "transformer_engine"], "dispatch"),  # whole layer captured
        (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn"], "skip"),
        (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "mlp"], "skip"),
        (["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe"], "dispatch"),
        (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router"], "dispatch"),
        (["--cuda-graph-impl", "full_iteration"], "dispatch"),
        (["--cuda-graph-impl", "none", "--cuda-graph-modules", "moe"], "skip"),
    ],
)
def test_auto_follows_which_modules_cuda_graphs_capture(graphs: list[str], auto: str) -> None:
    """Graphs that leave the MoE layer out (attention or dense MLP only) keep ``auto`` = skip;
    any capture of the MoE layer, its router or its preprocess (or the whole layer or
    iteration) needs static shapes: dispatch. Parsed by Megatron's own parser (its enums)."""
    from megatron_ext.training.arguments import configs_from_args
    from megatron_ext.training.feature_configs import MoEPadRoutingConfig

    args = _parse(["--num-experts", "8", "--moe-token-dispatcher-type", "alltoall", *graphs])
    mode, why = configs_from_args(args)[MoEPadRoutingConfig].resolve(args)
    assert (mode, why.startswith("auto")) == (auto, True), why


def test_count_router_tokens_splits_a_packed_row_per_document() -> None:
    """The host count of a CP rank's real rows: the pad mask sliced as Megatron's per-document
    split slices it (TE's index), not as the zigzag of the whole row would."""
    from megatron_ext.common.thd_partition import thd_partitioned_indices
    from megatron_ext.moe.pad_routing import count_router_tokens

    # Documents of 8 and 4, a 4-token tail pad (its own segment).
    cu = torch.tensor([0, 8, 12, 16], dtype=torch.int32)
    pads = torch.zeros(1, 16, dtype=torch.bool)
    pads[0, 12:] = True
    for rank in range(2):
        rows, real = count_router_tokens(pads, (1, 16), cp_size=2, cp_rank=rank, cu_seqlens=cu)
        index = thd_partitioned_indices(cu, 16, 2, rank).long()
        assert (rows, real) == (8, 8 - int(pads[0, index].sum()))
        assert real == 6  # the tail pad split evenly: 2 pads on each rank
    # The zigzag of the whole row would give rank 0 all 4 pads (positions 12..15).
    assert count_router_tokens(pads, (1, 16), cp_size=2, cp_rank=0) == (8, 4)
