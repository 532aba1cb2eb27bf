"""Tier: Megatron on one rank (its real argument parser; no process group). The moe section of
megatron_ext/config.py: flags, validation, refusals naming both flags."""

import argparse

import pytest

from megatron_ext.config import MoEAlignmentConfig


def _args(**kw) -> argparse.Namespace:
    base = {
        "moe_router_padding_for_quantization": False,
        "moe_pad_expert_input_to_capacity": False,
        "moe_token_dispatcher_type": "alltoall",
        "fp8": None,
        "fp8_recipe": "delayed",
        "fp4": None,
        "fp4_recipe": "nvfp4",
    }
    return argparse.Namespace(**{**base, **kw})


def test_flags_parse_with_megatrons_parser():
    from megatron.training.arguments import parse_args

    from megatron_ext.arguments import add_megatron_ext_args, configs_from_args

    argv = ["--moe-dispatch-align", "--moe-dispatch-align-size", "64", "--fp8-format", "e4m3"]
    import sys

    old, sys.argv = sys.argv, ["x", *argv]
    try:
        args = parse_args(extra_args_provider=add_megatron_ext_args, ignore_unknown_args=True)
    finally:
        sys.argv = old
    cfg = configs_from_args(args)[MoEAlignmentConfig]
    assert cfg.moe_dispatch_align and cfg.moe_dispatch_align_size == 64
    assert cfg.moe_dispatch_align_buffer == "host_counts" and not cfg.moe_expert_load_metrics


def test_align_size_from_precision():
    on = MoEAlignmentConfig(moe_dispatch_align=True)
    kw = {"fp8": None, "fp8_recipe": None, "fp4": None, "fp4_recipe": None}
    assert on.align_size(**kw) == 0
    assert on.align_size(**{**kw, "fp8": "hybrid", "fp8_recipe": "delayed"}) == 16
    assert on.align_size(**{**kw, "fp8": "e4m3", "fp8_recipe": "mxfp8"}) == 32
    assert on.align_size(**{**kw, "fp4": "e2m1", "fp4_recipe": "nvfp4"}) == 128
    assert MoEAlignmentConfig(moe_dispatch_align=False).align_size(**{**kw, "fp8": "e4m3"}) == 0


def test_refusals_name_both_flags():
    on = MoEAlignmentConfig(moe_dispatch_align=True)
    with pytest.raises(ValueError, match="--moe-dispatch-align-size"):
        MoEAlignmentConfig(moe_dispatch_align_size=-1)
    with pytest.raises(ValueError, match="--moe-router-padding-for-quantization"):
        on.check_megatron_args(_args(moe_router_padding_for_quantization=True, fp8="e4m3"))
    with pytest.raises(ValueError, match="--moe-pad-expert-input-to-capacity"):
        on.check_megatron_args(_args(moe_pad_expert_input_to_capacity=True))
    override = MoEAlignmentConfig(moe_dispatch_align=True, moe_dispatch_align_size=64)
    with pytest.raises(ValueError, match="--moe-token-dispatcher-type flex"):
        override.check_megatron_args(_args(moe_token_dispatcher_type="flex", fp8="e4m3"))
    with pytest.warns(UserWarning, match="bf16"):
        override.check_megatron_args(_args())
    on.check_megatron_args(_args(fp8="e4m3"))  # the supported combination passes
    MoEAlignmentConfig().check_megatron_args(_args(moe_router_padding_for_quantization=True))
