"""Tests for megatron_ext.replay.config (ReplayConfig). Tier: Megatron on one rank (its real
argument parser, no process group); the dry run calls the same checks."""

import sys

import numpy as np
import pytest
from megatron.training.arguments import parse_args

from megatron_ext.arguments import add_megatron_ext_args, configs_from_args
from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.replay.config import ReplayConfig

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
