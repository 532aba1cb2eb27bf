"""Tests for megatron_ext.data.quantization_align. Tier: Megatron on one rank (its real argument
parser and its fp8/fp4 alignment functions, no process group).

The pack-length multiple under fp8/fp4 is Megatron's own GEMM alignment, for every recipe Megatron
knows: ``get_fp8_align_size`` / ``get_fp4_align_size`` are the reference, not a table of ours.
"""

import sys

import pytest
from megatron.core.enums import Fp4Recipe, Fp8Recipe
from megatron.core.fp4_utils import get_fp4_align_size
from megatron.core.fp8_utils import get_fp8_align_size
from megatron.training.arguments import parse_args

from megatron_ext.data.quantization_align import quantization_align, quantization_align_from_args
from megatron_ext.training.arguments import add_megatron_ext_args, configs_from_args
from megatron_ext.training.dataset_provider import pad_multiple_from_args
from megatron_ext.training.feature_configs import PaddingConfig


def parsed(argv: list[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    return parse_args(extra_args_provider=add_megatron_ext_args)


@pytest.mark.parametrize("recipe", list(Fp8Recipe), ids=lambda r: r.value)
def test_every_fp8_recipe_is_megatrons_alignment(recipe: Fp8Recipe) -> None:
    expected = get_fp8_align_size(recipe)
    assert quantization_align(fp8="e4m3", fp8_recipe=recipe) == expected
    assert quantization_align(fp8="hybrid", fp8_recipe=recipe.value) == expected  # parsed form


@pytest.mark.parametrize("recipe", list(Fp4Recipe), ids=lambda r: r.value)
def test_every_fp4_recipe_is_megatrons_alignment(recipe: Fp4Recipe) -> None:
    expected = get_fp4_align_size(recipe)
    assert quantization_align(fp4="e2m1", fp4_recipe=recipe) == expected
    assert quantization_align(fp4="e2m1", fp4_recipe=recipe.value) == expected


def test_recipes_differ_where_megatron_says_so() -> None:
    # Non-vacuous: the recipes do not all share one value (mxfp8 32, the other fp8 16, nvfp4 128).
    assert quantization_align(fp8="e4m3", fp8_recipe="mxfp8") == 32
    assert quantization_align(fp8="e4m3", fp8_recipe="tensorwise") == 16
    assert quantization_align(fp4="e2m1", fp4_recipe="nvfp4") == 128
    assert quantization_align(fp8="e4m3") == get_fp8_align_size(Fp8Recipe.delayed)  # default
    assert quantization_align() == 1  # bf16/fp16: no constraint


@pytest.mark.parametrize("op_fuser", [False, True])
@pytest.mark.parametrize(
    "precision",
    [{}, *({"fp8": "e4m3", "fp8_recipe": r} for r in Fp8Recipe), {"fp4": "e2m1"}],
    ids=lambda p: p.get("fp8_recipe", p.get("fp4", "bf16")),
)
def test_megatron_align_size_is_megatrons_function(precision: dict, op_fuser: bool) -> None:
    """The MoE multiple's source: Megatron's get_align_size_for_quantization on a config, recipe
    names given as strings (as parsed) read as Megatron's enums."""
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.data.quantization_align import megatron_align_size

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    cfg.use_transformer_engine_op_fuser = op_fuser  # set after build: no TE to validate them
    for name, value in precision.items():
        setattr(cfg, name, value)
    expected = get_align_size_for_quantization(cfg)
    if "fp4" in precision:
        cfg.fp4_recipe = None  # unset: Megatron's default recipe
        expected = get_fp4_align_size(Fp4Recipe.nvfp4) if not op_fuser else 256
    assert megatron_align_size(cfg) == expected
    # Without the op fuser: the pack-length multiple's value (0 where that one says 1, bf16).
    assert megatron_align_size(cfg, op_fuser=False) == (
        quantization_align(**precision) if precision else 0
    )


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match=r"--fp8-recipe 'mx' is not one of Megatron's recipes"):
        quantization_align(fp8="e4m3", fp8_recipe="mx")
    with pytest.raises(ValueError, match="--fp8-format and --fp4-format cannot be used together"):
        quantization_align(fp8="e4m3", fp4="e2m1")


@pytest.mark.parametrize(
    "argv",
    # Each parse costs ~2 s: bf16, fp8's default recipe and the two that differ (every recipe's
    # value is checked against Megatron's functions above, without the parser).
    [
        [],
        ["--fp8-format", "e4m3"],
        ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"],
        ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"],
    ],
    ids=lambda argv: "-".join(a.lstrip("-") for a in argv) or "bf16",
)
def test_parsed_runs_pad_to_megatrons_multiple(argv, monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's parser -> the training entry's pack-length multiple, TP=2 with SP on top."""
    tp_sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    args = parsed([*argv, *tp_sp, "--seq-length", "1024"], monkeypatch)
    if args.fp8:
        expected = get_fp8_align_size(Fp8Recipe(args.fp8_recipe))
    elif args.fp4:
        expected = get_fp4_align_size(Fp4Recipe(args.fp4_recipe))
    else:
        expected = 1
    assert quantization_align_from_args(args) == expected
    assert pad_multiple_from_args(args) == max(expected, 2)  # lcm with TP = 2 (powers of 2)


def test_seq_length_must_fit_the_mxfp8_multiple(monkeypatch: pytest.MonkeyPatch) -> None:
    # 48 is a multiple of fp8's 16, not of mxfp8's 32: refused at argument time for mxfp8 only.
    base = ["--seq-length", "48", "--fp8-format", "e4m3", "--fp8-recipe"]
    configs_from_args(parsed([*base, "tensorwise"], monkeypatch))
    with pytest.raises(ValueError, match="--seq-length 48 is not a multiple of .* multiple 32"):
        configs_from_args(parsed([*base, "mxfp8"], monkeypatch))
    with pytest.raises(ValueError, match=r"--pad-to-multiple-of 16 conflicts .* needs 128\)"):
        configs_from_args(
            parsed(["--pad-to-multiple-of", "16", "--fp4-format", "e2m1"], monkeypatch)
        )
    assert PaddingConfig().pad_multiple(quantization_align=32) == 32
