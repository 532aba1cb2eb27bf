"""``--cpu`` with ``--fp8-format`` / ``--fp4-format``: a rehearsal of the quantized run's MoE alignment.

A CPU has no fp8 grouped GEMM and Megatron cannot build an fp8 ``TransformerConfig`` without
Transformer Engine: the model computes unquantized while expert groups are aligned to the recipe's
multiple (fp8 16, mxfp8 32, nvfp4 128) and checked as the real kernels would (docs/limits.md)::

    precision = take_quantization(args)      # args.fp8/fp4 cleared; Megatron builds a bf16 model
    model = ...build...
    rehearse_quantized_moe(model, precision) # MoE layers now align as the fp8 run would
"""

import argparse
import copy
from typing import Any

_PRECISION_FIELDS = ("fp8", "fp8_recipe", "fp4", "fp4_recipe")


def take_quantization(args: argparse.Namespace) -> dict[str, Any] | None:
    """Removes fp8/fp4 from ``args`` (so Megatron builds an unquantized model) and returns it."""
    from megatron_ext.config.megatron_view import MegatronView

    view = MegatronView.from_args(args)
    if not (view.fp8 or view.fp4):
        return None
    precision = {name: getattr(view, name) for name in _PRECISION_FIELDS}
    args.fp8 = None
    args.fp4 = None
    # Later checks of the same arguments see the rehearsal (--moe-dispatch-align still applies).
    args.rehearsed_precision = precision
    return precision


def describe(precision: dict[str, Any]) -> str:
    """``--fp8-format e4m3 --fp8-recipe tensorwise`` (or the fp4 pair) for messages."""
    if precision.get("fp8"):
        return f"--fp8-format {precision['fp8']} --fp8-recipe {precision['fp8_recipe']}"
    return f"--fp4-format {precision['fp4']} --fp4-recipe {precision['fp4_recipe']}"


class GroupLog:
    """What reached the grouped GEMMs during a rehearsal: group count, bad groups, last sizes."""

    def __init__(self) -> None:
        self.groups = 0
        self.unaligned = 0
        self.last: list[int] = []
        self.align = 0

    def hook(self, module: Any, inputs: tuple[Any, ...]) -> None:
        """Forward pre-hook of a ``GroupedMMLinear``: its host group sizes (no device read)."""
        sizes = [int(n) for n in inputs[1]]
        self.groups += len(sizes)
        self.unaligned += sum(1 for n in sizes if self.align > 1 and n % self.align)
        self.last = sizes

    def summary(self) -> str:
        return (
            f"{self.groups} expert groups reached the grouped GEMM, {self.unaligned} not a "
            f"multiple of {self.align}; last: {self.last}"
        )


def rehearse_quantized_moe(
    model: Any, precision: dict[str, Any], log: GroupLog | None = None
) -> list[int]:
    """Gives every ``AlignedMoELayer`` of ``model`` (a module or list of stages) a quantized view of
    its config; returns each layer's alignment multiple (for the startup message and tests).

    With ``log``, every grouped-GEMM expert linear records the group sizes it is handed.
    """
    from megatron_ext.moe.grouped_mm_linear import GroupedMMLinear
    from megatron_ext.moe.moe_layer import AlignedMoELayer

    stages = model if isinstance(model, list) else [model]
    aligns = []
    for stage in stages:
        for layer in stage.modules():
            if not isinstance(layer, AlignedMoELayer):
                continue
            original = layer.config
            view = copy.copy(original)  # no __post_init__: fp8 without Transformer Engine is fine
            for name, value in precision.items():
                setattr(view, name, value)
            # Only the dispatcher, its aligner and the routed experts (GroupedMMLinear raises on an
            # unaligned group, as the real kernels do). The layer keeps its config: its precision
            # only picks TE's te_checkpoint for --recompute-modules moe / shared_experts, absent on
            # CPU. Shared experts, attention, dense MLPs, norms and the router are untouched.
            dispatcher = layer.token_dispatcher
            owners = [*layer.experts.modules(), dispatcher, getattr(dispatcher, "aligner", None)]
            for owner in owners:
                if owner is not None and getattr(owner, "config", None) is original:
                    owner.config = view
            align = layer.realign(view)  # decided at construction: pass the new one down
            aligns.append(align)
            if log is not None:
                log.align = align
                for module in layer.modules():
                    if isinstance(module, GroupedMMLinear):
                        module.register_forward_pre_hook(log.hook)
    return aligns
