"""Tier: pure (argparse namespaces, as Megatron's validate_args leaves them). What Megatron 0.19.2
validates and then fails on after startup is refused at argument time, naming the flags; the
configurations of the examples' documented launches pass."""

import argparse

import pytest

from megatron_ext.training.launch_args import check_launch_args

OK = dict(num_experts=8, world_size=8, tensor_model_parallel_size=1, expert_model_parallel_size=8)
OK.update(pipeline_model_parallel_size=1, eval_interval=1000, lr=1e-4)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        # pretrain_moe_blended.sh's sizes on one node of 8: expert grid 2 x 8 = 16
        ({"tensor_model_parallel_size": 2}, "= 16 does not divide the world size 8"),
        ({"expert_tensor_parallel_size": 2}, "--expert-tensor-parallel-size 2"),
        ({"pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size 2 = 16"),
        ({"eval_interval": None}, "--eval-interval is required when training"),
        # Megatron's OptimizerParamScheduler took float(None): a TypeError traceback, dry run too
        ({"lr": None}, "--lr is required when training"),
        ({"lr": None, "skip_train": True, "perform_rl_step": True}, "--lr is required"),
    ],
)
def test_refused_naming_the_flags(change, named):
    with pytest.raises(ValueError) as err:
        check_launch_args(argparse.Namespace(**{**OK, **change}))
    assert named in str(err.value)


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"tensor_model_parallel_size": 2, "world_size": 32},  # pretrain_moe_blended: 4 nodes
        {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 4},  # rl_route_replay
        {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1},  # expert TP 1
        {"num_experts": None, "expert_model_parallel_size": 16},  # dense: no expert grid
        {"eval_interval": None, "skip_train": True},  # evaluation only: no interval needed
        {"eval_interval": None, "full_validation": True},  # Megatron counts no samples then
        {"lr": None, "skip_train": True},  # no optimizer: Megatron's launch runs without --lr
    ],
)
def test_launchable_configurations_pass(change):
    check_launch_args(argparse.Namespace(**{**OK, **change}))
