"""Tier: pure, plus Megatron's router on one gloo rank. Replay flags and argument-time refusals.

Covers megatron_ext/replay/unsupported.py and the replay section of megatron_ext/training/feature_configs.py: every
configuration where Megatron 0.19.2 would silently skip replay is refused with the flags named,
and (for the settings a CPU reaches) Megatron's own router is shown not to replay under them.
"""

import argparse
import dataclasses

import numpy as np
import pytest

from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.replay.unsupported import replay_blockers
from megatron_ext.training.arguments import add_megatron_ext_args
from megatron_ext.training.feature_configs import ReplayConfig


def _args(**overrides) -> argparse.Namespace:
    base = {
        "num_experts": 8,
        "moe_router_fusion": False,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_expert_capacity_factor": None,
        "cuda_graph_impl": "none",
        "hybrid_context_parallel": False,
        "pack_documents": True,
        "data_path": [],
    }
    return argparse.Namespace(**{**base, **overrides})


def test_flags_parse_into_the_config():
    parser = add_megatron_ext_args(argparse.ArgumentParser())
    ns = parser.parse_args(
        [
            "--route-replay-mode",
            "record",
            "--route-record-path",
            "/tmp/r",
            "--replay-missing-route-policy",
            "balanced",
        ]
    )
    assert (ns.route_replay_mode, ns.route_record_path, ns.replay_missing_route_policy) == (
        "record",
        "/tmp/r",
        "balanced",
    )
    assert ns.route_data_suffix is None


def test_supported_config_has_no_blockers():
    assert replay_blockers(_args()) == []
    ReplayConfig(route_replay_mode="record", route_record_path="/tmp/r").check_megatron_args(
        _args()
    )


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"moe_router_fusion": True}, "--moe-router-fusion"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, "sinkhorn"),
        (
            {"moe_router_load_balancing_type": ["seq_aux_loss", "quantile_balancing"]},
            "quantile_balancing",
        ),
        ({"moe_expert_capacity_factor": 1.25}, "--moe-expert-capacity-factor"),
        ({"cuda_graph_impl": "local"}, "--cuda-graph-impl local"),
        ({"hybrid_context_parallel": True}, "--hybrid-context-parallel"),
        ({"num_experts": None}, "--num-experts"),
    ],
)
def test_silent_skip_configs_are_refused_at_argument_time(overrides, flag):
    cfg = ReplayConfig(route_replay_mode="record", route_record_path="/tmp/r")
    with pytest.raises(ValueError, match="--route-replay-mode record") as err:
        cfg.check_megatron_args(_args(**overrides))
    assert flag in str(err.value)
    ReplayConfig().check_megatron_args(_args(**overrides))  # mode off: nothing to refuse


def test_replay_with_missing_route_file_names_the_file(tmp_path):
    prefix = str(tmp_path / "tokens")
    write_documents(prefix, [np.arange(1, 4)])
    cfg = ReplayConfig(route_replay_mode="replay", route_data_suffix="_routes")
    with pytest.raises(ValueError, match=r"route file .*tokens_routes\.bin .* does not exist"):
        cfg.check_megatron_args(_args(data_path=["1.0", prefix]))
    write_documents(prefix + "_routes", [np.zeros((3, 2, 2), np.uint8)], dtype=np.uint8)
    # No header, so no tokens digest: replayed only when allowed.
    with pytest.raises(ValueError, match=r"tokens_routes has no header .*undigested$"):
        cfg.check_megatron_args(_args(data_path=["1.0", prefix]))
    allowed = dataclasses.replace(cfg, route_replay_allow_undigested=True)
    allowed.check_megatron_args(_args(data_path=["1.0", prefix]))


def test_replay_needs_the_packed_dataset():
    cfg = ReplayConfig(route_replay_mode="replay", route_data_suffix="_routes")
    with pytest.raises(ValueError, match="--pack-documents"):
        cfg.check_megatron_args(_args(pack_documents=False))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"route_replay_mode": "replay"}, "needs --route-data-suffix"),
        ({"route_replay_mode": "record"}, "needs --route-record-path"),
        ({"route_replay_mode": "record", "route_record_path": "/no/such/dir/r"}, "/no/such/dir"),
        ({"route_replay_mode": "R3"}, "--route-replay-mode must be"),
        ({"replay_missing_route_policy": "zeros"}, "--replay-missing-route-policy must be"),
    ],
)
def test_bad_flag_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReplayConfig(**kwargs)


def test_flags_without_effect_warn():
    with pytest.warns(
        UserWarning, match="--route-data-suffix has no effect with --route-replay-mode off"
    ):
        ReplayConfig(route_data_suffix="_routes")
    with pytest.warns(UserWarning, match="--route-record-path has no effect"):
        ReplayConfig(route_replay_mode="replay", route_data_suffix="_r", route_record_path="/tmp/x")


def _megatron_replay_under(setting: str) -> dict:
    """Megatron's own TopKRouter with its RouterReplay set to replay targets that differ from its
    natural routing: does the routing map it returns hold the targets?"""
    import torch
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from megatron_ext.testing import tiny_moe_config

    overrides = {
        "plain": {},
        "sinkhorn": dict(
            moe_router_load_balancing_type="sinkhorn", moe_router_topk=1, moe_aux_loss_coeff=0.0
        ),
        "quantile_balancing": dict(
            moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0
        ),
        "capacity_factor": dict(moe_expert_capacity_factor=0.5),
    }[setting]
    cfg = tiny_moe_config(moe_enable_routing_replay=True, **overrides)
    router = TopKRouter(config=cfg, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    x = torch.randn(16, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        natural = router(x)[1]
        # Targets: every token's natural experts shifted by one, so all differ from natural.
        topk = cfg.moe_router_topk
        targets = (natural.float().topk(topk, dim=1).indices + 1) % cfg.num_moe_experts
        router.router_replay.set_target_indices(targets)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            replayed = router(x)[1]
        finally:
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_router_replay_instances()
    wanted = torch.zeros_like(replayed).scatter_(1, targets, True)
    return {"holds": torch.equal(replayed, wanted), "differs": not torch.equal(natural, wanted)}


@pytest.mark.parametrize("setting", ["sinkhorn", "quantile_balancing", "capacity_factor"])
def test_megatron_itself_does_not_replay_under_the_refused_settings(setting: str) -> None:
    """The refusal's premise, shown on Megatron's own router (the CPU-reachable rows of the
    table; the fused top-k needs TE and CUDA graphs a GPU): with its RouterReplay set to replay,
    the plain router returns exactly the targets, these settings do not, with no error."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_ext.testing import run_distributed

    if setting == "quantile_balancing" and not hasattr(TopKRouter, "quantile_balancing"):
        pytest.skip("megatron-core 0.18.2 has no quantile balancing (its flag refuses the value)")
    plain = run_distributed(_megatron_replay_under, 1, "plain")[0]
    other = run_distributed(_megatron_replay_under, 1, setting)[0]
    assert plain["differs"] and plain["holds"], plain  # control: replay works without them
    assert other["differs"] and not other["holds"], other


def test_virtual_pipeline_stages_are_refused_for_a_hybrid_model_only():
    from megatron_ext.replay.unsupported import check_virtual_pipeline

    settings = argparse.Namespace(
        virtual_pipeline_model_parallel_size=2,
        route_replay_mode="replay",
        hybrid_layer_pattern=None,
    )
    check_virtual_pipeline(settings)  # a GPTModel's chunks each get their binding
    settings.hybrid_layer_pattern = "*E*E"
    with pytest.raises(ValueError, match="GPTModel only, not a HybridModel"):
        check_virtual_pipeline(settings)
    settings.virtual_pipeline_model_parallel_size = None  # no virtual stages: any model
    check_virtual_pipeline(settings)
