"""Tier: Megatron on one rank (its real argument parser; no process group). The moe section of
megatron_ext/training/feature_configs.py: flags, validation, refusals naming both flags."""

import argparse
import sys
import warnings

import pytest

import megatron_ext.moe.config as moe_config_module
from megatron_ext.training.feature_configs import MoEAlignmentConfig


@pytest.fixture(autouse=True)
def _fresh_warn_once(monkeypatch):
    """Each test sees the once-per-process warnings anew."""
    monkeypatch.setattr(moe_config_module, "_MOE_WARNED", set())  # the set _moe_warn_once reads


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

    from megatron_ext.training.arguments import add_megatron_ext_args, configs_from_args

    argv = ["--moe-dispatch-align", "--moe-dispatch-align-size", "64", "--fp8-format", "e4m3"]
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
        MoEAlignmentConfig(moe_dispatch_align=True, moe_dispatch_align_size=-1)
    # An override alone would be accepted and ignored (no group is aligned without the switch).
    with pytest.raises(ValueError, match="--moe-dispatch-align-size 32 needs --moe-dispatch-align"):
        MoEAlignmentConfig(moe_dispatch_align_size=32)
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


def _parse(argv: list[str]) -> argparse.Namespace:
    from megatron.training.arguments import parse_args

    from megatron_ext.training.arguments import add_megatron_ext_args

    old, sys.argv = sys.argv, ["x", *argv]
    try:
        return parse_args(extra_args_provider=add_megatron_ext_args, ignore_unknown_args=True)
    finally:
        sys.argv = old


@pytest.mark.parametrize(
    "precision, override",
    [
        ({"fp8": "e4m3", "fp8_recipe": "mxfp8"}, 0),
        ({"fp8": "e4m3", "fp8_recipe": "mxfp8"}, 1),
        ({"fp8": "e4m3", "fp8_recipe": "mxfp8"}, 8),
        ({"fp8": "e4m3", "fp8_recipe": "mxfp8"}, 24),
        ({"fp8": "e4m3", "fp8_recipe": "mxfp8"}, 48),  # a multiple of 16, not of 32
        ({"fp8": "hybrid", "fp8_recipe": "tensorwise"}, 24),
        ({"fp4": "e2m1", "fp4_recipe": "nvfp4"}, 64),
        ({"fp8": "e4m3", "fp8_recipe": "delayed", "use_transformer_engine_op_fuser": True}, 128),
    ],
)
def test_override_must_be_a_multiple_of_megatrons_align(precision, override):
    cfg = MoEAlignmentConfig(moe_dispatch_align=True, moe_dispatch_align_size=override)
    recipe_flag = "--fp8-recipe" if "fp8" in precision else "--fp4-recipe"
    with pytest.raises(ValueError, match="--moe-dispatch-align-size") as err:
        cfg.check_megatron_args(_args(**precision))
    assert recipe_flag in str(err.value)


@pytest.mark.parametrize(
    "precision, override",
    [
        ({"fp8": "e4m3", "fp8_recipe": "mxfp8"}, 32),
        ({"fp8": "e4m3", "fp8_recipe": "mxfp8"}, 256),
        ({"fp8": "hybrid", "fp8_recipe": "tensorwise"}, 48),
        ({"fp4": "e2m1", "fp4_recipe": "nvfp4"}, 256),
        ({"fp8": "e4m3", "fp8_recipe": "delayed", "use_transformer_engine_op_fuser": True}, 512),
    ],
)
def test_override_multiple_of_megatrons_align_passes(precision, override):
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    cfg = MoEAlignmentConfig(moe_dispatch_align=True, moe_dispatch_align_size=override)
    cfg.check_megatron_args(_args(**precision))
    megatron = get_align_size_for_quantization(
        argparse.Namespace(
            **{"use_transformer_engine_op_fuser": False, "fp8": None, "fp4": None, **precision}
        )
    )
    assert megatron > 1 and override % megatron == 0  # what the check compared against


def test_unaligned_override_refused_through_megatrons_parser():
    from megatron_ext.training.arguments import configs_from_args

    args = _parse(
        ["--moe-dispatch-align", "--moe-dispatch-align-size", "24", "--fp8-format", "e4m3"]
        + ["--fp8-recipe", "mxfp8", "--num-experts", "8"]
    )
    with pytest.raises(ValueError, match="--moe-dispatch-align-size 24.*--fp8-recipe mxfp8"):
        configs_from_args(args)


def test_load_metrics_on_a_dense_model_refused():
    from megatron_ext.training.arguments import configs_from_args

    cfg = MoEAlignmentConfig(moe_expert_load_metrics=True)
    with pytest.raises(ValueError, match="--moe-expert-load-metrics.*--num-experts"):
        cfg.check_megatron_args(_args(num_experts=None))
    cfg.check_megatron_args(_args(num_experts=8))
    with pytest.raises(ValueError, match="--num-experts"):
        configs_from_args(_parse(["--moe-expert-load-metrics"]))


def test_align_under_bf16_warns_once():
    on = MoEAlignmentConfig(moe_dispatch_align=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        on.check_megatron_args(_args())
        on.check_megatron_args(_args())
    messages = [str(w.message) for w in seen]
    assert len(messages) == 1 and "--moe-dispatch-align has no effect" in messages[0], messages
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        on.check_megatron_args(_args(fp8="e4m3"))  # fp8: it has an effect, no warning
    assert not seen


def test_align_size_override_under_bf16_warns_it_has_no_effect():
    """The override pads nothing under bf16 (the multiple stays 0), and the warning says so."""
    from megatron_ext.moe.config import align_size_for_config

    on = MoEAlignmentConfig(moe_dispatch_align=True, moe_dispatch_align_size=64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        on.check_megatron_args(_args())
    messages = [str(w.message) for w in seen]
    assert len(messages) == 1, messages
    assert "--moe-dispatch-align-size 64 has no effect" in messages[0], messages
    bf16 = argparse.Namespace(fp8=None, fp4=None, use_transformer_engine_op_fuser=False)
    assert align_size_for_config(bf16, on) == 0  # what the warning states


def test_load_log_needs_load_metrics():
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    with pytest.raises(ValueError, match="--moe-expert-load-log needs --moe-expert-load-metrics"):
        MoEAlignmentConfig(moe_expert_load_log="load.jsonl")
    MoEAlignmentConfig(moe_expert_load_log="load.jsonl", moe_expert_load_metrics=True)


def test_load_log_that_appending_would_damage_is_refused(tmp_path):
    """A review appended JSON lines to the training data's .bin (exit 0); a missing directory
    failed after the first iteration. Both are settled at argument time now."""
    from megatron_ext.moe.config import check_load_log

    data = tmp_path / "corpus.bin"
    data.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"--moe-expert-load-log .*corpus\.bin exists and is not"):
        check_load_log(str(data))
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    with pytest.raises(ValueError, match="is not an expert-load log"):
        check_load_log(str(text))
    with pytest.raises(ValueError, match="is a directory"):
        check_load_log(str(tmp_path))
    earlier = tmp_path / "load.jsonl"
    earlier.write_text('{"iteration": 5, "layer1/tokens": [1, 2]}\n')
    check_load_log(str(earlier))  # a previous run's log: appended to
    check_load_log(str(tmp_path / "new" / "dir" / "load.jsonl"))  # created on first write
    (tmp_path / "empty.jsonl").write_text("")
    check_load_log(str(tmp_path / "empty.jsonl"))
