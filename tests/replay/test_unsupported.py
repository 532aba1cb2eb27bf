"""Tier: pure (no Megatron process group). Replay flags and argument-time refusals.

Covers megatron_ext/replay/unsupported.py and the replay section of megatron_ext/config.py: every
configuration where Megatron 0.19.2 would silently skip replay is refused with the flags named.
"""

import argparse

import numpy as np
import pytest

from megatron_ext.arguments import add_megatron_ext_args
from megatron_ext.config import ReplayConfig
from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.replay.unsupported import replay_blockers


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
    cfg.check_megatron_args(_args(data_path=["1.0", prefix]))


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
