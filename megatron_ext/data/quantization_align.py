"""The row multiple a run's fp8/fp4 GEMMs need, read from Megatron's own rules (Megatron glue).

A pack's length is the GEMMs' M dimension (tokens), so under fp8/fp4 the pack-length multiple must
include the quantized GEMM's alignment. Megatron states it in ``megatron.core.fp8_utils.
get_fp8_align_size`` (16; 32 for the mxfp8 recipe, whose 1x32 scale blocks run along M in the
weight-gradient GEMM) and ``megatron.core.fp4_utils.get_fp4_align_size`` (128; 32 is the hardware
minimum, 128 what the grouped nvfp4 kernels want). Reading them here, not from a table of our own,
keeps the pack length in step with Megatron. The pure math stays in :mod:`megatron_ext.data.padding`
(``derive_pad_multiple(quantization_align=...)``), which never imports megatron.

Example: ``--fp8-format e4m3 --fp8-recipe mxfp8`` -> ``quantization_align_from_args(args) == 32``.
"""

import argparse


def quantization_align(
    *, fp8: object = None, fp8_recipe: object = None, fp4: object = None, fp4_recipe: object = None
) -> int:
    """Megatron's GEMM row alignment for these precision settings; 1 without fp8/fp4.

    Args:
        fp8: Megatron's ``fp8`` (``--fp8-format``: ``"e4m3"``, ``"hybrid"``; None when off).
        fp8_recipe: ``--fp8-recipe`` (name or ``Fp8Recipe``); Megatron's default ``"delayed"``.
        fp4: Megatron's ``fp4`` (``--fp4-format``: ``"e2m1"``; None when off).
        fp4_recipe: ``--fp4-recipe`` (name or ``Fp4Recipe``); Megatron's default ``"nvfp4"``.

    Raises:
        ValueError: An unknown recipe name, or fp8 and fp4 together.
    """
    from megatron.core.enums import Fp4Recipe, Fp8Recipe

    if fp8 and fp4:
        raise ValueError("--fp8-format and --fp4-format cannot be used together")
    if fp8:
        from megatron.core.fp8_utils import get_fp8_align_size

        return get_fp8_align_size(_recipe(Fp8Recipe, fp8_recipe or "delayed", "--fp8-recipe"))
    if fp4:
        from megatron.core.fp4_utils import get_fp4_align_size

        return get_fp4_align_size(_recipe(Fp4Recipe, fp4_recipe or "nvfp4", "--fp4-recipe"))
    return 1


def quantization_align_from_args(args: argparse.Namespace) -> int:
    """:func:`quantization_align` of Megatron's parsed arguments (missing ones count as off)."""
    return quantization_align(
        fp8=getattr(args, "fp8", None),
        fp8_recipe=getattr(args, "fp8_recipe", None),
        fp4=getattr(args, "fp4", None),
        fp4_recipe=getattr(args, "fp4_recipe", None),
    )


def _recipe(enum: type, value: object, flag: str) -> object:
    name = getattr(value, "value", value)
    try:
        return enum(name)
    except ValueError:
        choices = [member.value for member in enum]
        raise ValueError(f"{flag} {name!r} is not one of Megatron's recipes {choices}") from None
