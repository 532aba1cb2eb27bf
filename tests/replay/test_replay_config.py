"""Tests for megatron_ext.replay.config (ReplayConfig). Tier: Megatron on one rank (its real
argument parser, no process group); the dry run calls the same checks."""

import sys

import numpy as np
import pytest
from megatron.training.arguments import parse_args

from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.replay.config import ReplayConfig
from megatron_ext.training.arguments import add_megatron_ext_args, configs_from_args

MOE = [
    "--num-experts",
    "8",
    "--moe-router-topk",
    "2",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "1",
]


def configs(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> ReplayConfig:
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MOE, *argv])
    return configs_from_args(parse_args(extra_args_provider=add_megatron_ext_args))[ReplayConfig]


@pytest.fixture
def prefix(tmp_path) -> str:
    write_documents(str(tmp_path / "d"), [np.arange(1, 5)])
    write_documents(str(tmp_path / "d_lm"), [np.ones(4)], dtype=np.uint8)
    write_documents(str(tmp_path / "old_rec"), [np.ones(4)], dtype=np.uint8)
    return str(tmp_path / "d")


@pytest.mark.parametrize(
    "record, match",
    [
        ("{P}", r"--route-record-path .*d\.bin is an input"),  # would destroy the tokens
        ("{P}_lm", r"--route-record-path .*d_lm\.bin is an input"),  # ... or the loss mask
        # ... or an earlier recording; pretrain_gpt has no --overwrite, so the hint names none
        ("{dir}/old_rec", r"old_rec\.bin already exists; choose a new --route-record-path"),
    ],
)
def test_record_path_never_overwrites_data(monkeypatch, prefix, record, match) -> None:
    directory = prefix.rsplit("/", 1)[0]
    argv = ["--data-path", prefix, "--pack-documents", "--pack-loss-mask-suffix", "_lm"]
    argv += ["--route-replay-mode", "record"]
    argv += ["--route-record-path", record.replace("{P}", prefix).replace("{dir}", directory)]
    with pytest.raises(ValueError, match=match):
        configs(argv, monkeypatch)


def test_a_fresh_record_path_is_accepted(monkeypatch, prefix) -> None:
    argv = ["--data-path", prefix, "--route-replay-mode", "record", "--pack-documents"]
    cfg = configs([*argv, "--route-record-path", prefix + "_rec"], monkeypatch)
    assert cfg.route_record_path == prefix + "_rec"


def test_route_replay_check_needs_replay_mode():
    with pytest.raises(ValueError, match="--route-replay-check needs --route-replay-mode replay"):
        ReplayConfig(route_replay_check=True, route_replay_mode="record")
    ReplayConfig(route_replay_check=True, route_replay_mode="replay", route_data_suffix="_routes")


def test_route_replay_max_missing_parses_as_a_fraction(monkeypatch) -> None:
    for argv, want in (([], 0.05), (["--route-replay-max-missing", "1"], 1.0)):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MOE, *argv])
        args = parse_args(extra_args_provider=add_megatron_ext_args)
        assert args.route_replay_max_missing == want
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="--route-replay-max-missing must be a fraction"):
            ReplayConfig(
                route_replay_mode="replay", route_data_suffix="_r", route_replay_max_missing=bad
            )
    with pytest.warns(UserWarning, match="--route-replay-max-missing has no effect without"):
        ReplayConfig(route_replay_max_missing=0.5)


def _route_file_for_layers(prefix: str, moe_layer_ids: list[int]) -> None:
    from megatron_ext.replay.route_dataset import write_route_sidecar

    routes = np.tile(np.array([0, 1], dtype=np.uint8), (4, len(moe_layer_ids), 1))
    write_route_sidecar(
        prefix + "_routes",
        [routes],
        num_layers=len(moe_layer_ids),
        topk=2,
        num_experts=8,
        moe_layer_ids=moe_layer_ids,
        overwrite=True,
        tokens_prefix=prefix,
    )


@pytest.mark.parametrize(
    "freq, match",
    [
        ("[0,1,1]", None),  # decoder layers 1 and 2 (0-based) are the model's MoE layers
        ("[1,0,1]", None),  # two MoE layers elsewhere: rows 0 and 1 replay on layers 0 and 2
        ("[0,0,1]", r"holds the routes of 2 MoE layers \(the source model's decoder layers 1-2, "
                    r"0-based\), but the model has 1 MoE layers \(2: --moe-layer-freq"),
    ],
)  # fmt: skip
def test_route_file_layers_checked_against_moe_layer_freq(monkeypatch, prefix, freq, match):
    """A sidecar converted from a per-decoder-layer dump records which decoder layers its rows
    belong to (the source's numbering); they map onto the model's MoE layers in order, so only
    another count of MoE layers is refused at argument time, naming both lists."""
    _route_file_for_layers(prefix, [1, 2])
    argv = ["--data-path", prefix, "--pack-documents", "--route-replay-mode", "replay"]
    argv += ["--route-data-suffix", "_routes", "--num-layers", "3", "--moe-layer-freq", freq]
    argv += ["--hidden-size", "8", "--num-attention-heads", "2"]
    if match is None:
        assert configs(argv, monkeypatch).route_replay_mode == "replay"
    else:
        with pytest.raises(ValueError, match=match):
            configs(argv, monkeypatch)


def test_route_file_layers_checked_against_hybrid_pattern(prefix):
    """A HybridModel's MoE layers are the E positions of --hybrid-layer-pattern (1-based layer
    numbers there, 0-based decoder layers in the header)."""
    from types import SimpleNamespace

    _route_file_for_layers(prefix, [1, 3])
    args = SimpleNamespace(hybrid_layer_pattern="*E*E", moe_router_topk=2, num_experts=8)
    ReplayConfig._check_header(prefix + "_routes", args)  # E at positions 2 and 4: layers 1, 3
    args.hybrid_layer_pattern = "EE**"  # two MoE layers, numbered otherwise: mapped in order
    ReplayConfig._check_header(prefix + "_routes", args)
    _route_file_for_layers(prefix, [0, 1])  # a 2-layer Hugging Face config's decoder layers
    args.hybrid_layer_pattern = "*E*E"
    ReplayConfig._check_header(prefix + "_routes", args)
    args.hybrid_layer_pattern = "*E*E*E"
    with pytest.raises(ValueError, match=r"decoder layers 0-1, 0-based\), but the model has 3 MoE "
                       r"layers \(1,3,5: --moe-layer-freq"):  # fmt: skip
        ReplayConfig._check_header(prefix + "_routes", args)
