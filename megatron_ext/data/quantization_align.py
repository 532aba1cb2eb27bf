"""The row multiple a run's fp8/fp4 GEMMs need, read from Megatron's own rules (Megatron glue).

Every alignment multiple in megatron_ext comes from Megatron-Core's
``get_align_size_for_quantization`` through here: the pack-length multiple (a pack's length is the
GEMMs' M dimension) and each MoE expert group's. The rules Megatron has none for are ours, stated
where decided (:func:`megatron_ext.moe.config.align_size_for_config`).

Example: ``--fp8-format e4m3 --fp8-recipe mxfp8`` -> ``quantization_align_from_args(args) == 32``.
"""

import argparse


def megatron_align_size(settings: object, *, op_fuser: bool | None = None) -> int:
    """Megatron's ``get_align_size_for_quantization`` of a config or parsed arguments.

    Args:
        settings: A ``TransformerConfig`` or Megatron's arguments (``fp8``, ``fp8_recipe``,
            ``fp4``, ``fp4_recipe``, ``use_transformer_engine_op_fuser``; missing ones are off).
        op_fuser: Overrides ``use_transformer_engine_op_fuser`` (None: read it from ``settings``).

    Returns:
        Megatron's multiple; 0 when it asks for none.
    """
    from megatron.core.enums import Fp4Recipe, Fp8Recipe
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    # megatron.core.transformer.moe.moe_utils: 256 under the op fuser (its CUTLASS grouped GEMM),
    # else fp8_utils.get_fp8_align_size (16; 32 for mxfp8, whose 1x32 scale blocks run along M in
    # the weight-gradient GEMM) or fp4_utils.get_fp4_align_size (128: 32 is the hardware minimum,
    # 128 what the grouped nvfp4 kernels want), 0 without fp8/fp4.
    if op_fuser is None:
        op_fuser = bool(getattr(settings, "use_transformer_engine_op_fuser", False))
    fp8, fp4 = getattr(settings, "fp8", None), getattr(settings, "fp4", None)
    # A recipe is read only when its format is on (Megatron ignores it otherwise).
    # Recipe names read as Megatron's enums, defaulting to Megatron's "delayed" / "nvfp4".
    fp8_recipe = getattr(settings, "fp8_recipe", None) or "delayed"
    fp4_recipe = getattr(settings, "fp4_recipe", None) or "nvfp4"
    view = argparse.Namespace(
        use_transformer_engine_op_fuser=op_fuser,
        fp8=fp8,
        fp8_recipe=_recipe(Fp8Recipe, fp8_recipe, "--fp8-recipe") if fp8 else None,
        fp4=fp4,
        fp4_recipe=_recipe(Fp4Recipe, fp4_recipe, "--fp4-recipe") if fp4 else None,
    )
    return get_align_size_for_quantization(view)


def quantization_align(
    *, fp8: object = None, fp8_recipe: object = None, fp4: object = None, fp4_recipe: object = None
) -> int:
    """Megatron's GEMM row alignment for these precision settings; 1 without fp8/fp4.

    ``fp8`` / ``fp4``: Megatron's (``--fp8-format`` / ``--fp4-format``; None when off); recipes
    are names or Megatron's enums.

    Raises:
        ValueError: An unknown recipe name, or fp8 and fp4 together.
    """
    if fp8 and fp4:
        raise ValueError("--fp8-format and --fp4-format cannot be used together")
    settings = argparse.Namespace(fp8=fp8, fp8_recipe=fp8_recipe, fp4=fp4, fp4_recipe=fp4_recipe)
    # The pack length is a dense GEMM's M as well as the experts': the op fuser's grouped-GEMM 256
    # is not part of it.
    return max(megatron_align_size(settings, op_fuser=False), 1)


def quantization_align_from_args(args: argparse.Namespace) -> int:
    """:func:`quantization_align` of Megatron's parsed arguments (missing ones count as off)."""
    from megatron_ext.config.megatron_view import MegatronView

    view = MegatronView.from_args(args)
    return quantization_align(
        fp8=view.fp8, fp8_recipe=view.fp8_recipe, fp4=view.fp4, fp4_recipe=view.fp4_recipe
    )


def _recipe(enum: type, value: object, flag: str) -> object:
    name = getattr(value, "value", value)
    try:
        return enum(name)
    except ValueError:
        choices = [member.value for member in enum]
        raise ValueError(f"{flag} {name!r} is not one of Megatron's recipes {choices}") from None
