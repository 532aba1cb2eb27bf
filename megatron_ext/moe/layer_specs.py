"""Layer-spec functions that switch Megatron models onto :class:`AlignedMoELayer` and
:class:`~megatron_ext.moe.router.PaddedTopKRouter`, wherever in a spec (stock or custom) the
``MoELayer`` and ``TopKRouter`` sit, for ``GPTModel`` and ``HybridModel`` alike::

    alignment = MoEAlignmentConfig(moe_dispatch_align=True)
    gpt_spec = get_aligned_gpt_layer_local_spec(alignment, num_experts=8)
    hybrid_spec = get_local_hybrid_stack_spec(num_experts=8, alignment=alignment)
    HybridModel(config, hybrid_spec, vocab_size, seq_len, hybrid_layer_pattern="*E*E")
"""

import dataclasses
import functools
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron_ext.common.spec_tree import map_spec, spec_parts
from megatron_ext.moe.config import MoEAlignmentConfig
from megatron_ext.moe.grouped_mm_linear import GroupedMMLinear
from megatron_ext.moe.load_metrics import ExpertLoadMetrics
from megatron_ext.moe.moe_layer import AlignedMoELayer
from megatron_ext.moe.pad_routing import PadRouting
from megatron_ext.moe.router import PaddedTopKRouter


def with_aligned_moe(
    spec: Any,
    alignment: MoEAlignmentConfig,
    load_metrics: ExpertLoadMetrics | None = None,
    *,
    padded_router: bool = True,
    pad_routing: PadRouting | None = None,
) -> Any:
    """Returns a copy of ``spec`` with every ``MoELayer`` replaced by ``AlignedMoELayer``.

    ``spec``: a layer, block or stack spec holding a ``MoELayer`` (else ValueError);
    ``pad_routing`` None routes pads like text; ``padded_router``: also :func:`with_padded_router`
    (needed with expert bias and a padding mask, the same as ``TopKRouter`` otherwise).
    """
    # Megatron's MoE models reach MoELayer through a functools.partial(MoELayer, ...) or a
    # ModuleSpec(module=MoELayer): both are swapped.
    found: list[bool] = []
    extra = {"alignment": alignment, "load_metrics": load_metrics, "pad_routing": pad_routing}
    out = _swap(spec, extra, found)
    if not found:
        already = _contains(spec, AlignedMoELayer)
        raise ValueError(
            "with_aligned_moe: the spec's MoE layers are already AlignedMoELayer (apply it once)"
            if already
            else "with_aligned_moe: the spec contains no MoELayer to align"
        )
    return with_padded_router(out) if padded_router else out


def with_padded_router(spec: Any, *, require: str | None = None) -> Any:
    """Returns ``spec`` with every ``MoESubmodules.router`` that is Megatron's ``TopKRouter``
    replaced by :class:`PaddedTopKRouter`; other routers (``InferenceTopKRouter``, a user's own)
    are kept, and parts without a router returned as they are (same objects).

    ``require``: a flag name (the model provider's ``"--moe-router-enable-expert-bias"``): every
    MoE router, and one at least, must then end up a ``PaddedTopKRouter`` (else ValueError).
    """
    routers: list[type] = []
    out = _walk_routers(spec, routers, swap=True)
    if require is not None:
        if not routers:
            raise ValueError(f"{require}: the model spec has no MoE layer (no MoESubmodules)")
        others = sorted({r.__qualname__ for r in routers if not _is_padded(r)})
        if others:
            raise ValueError(
                f"{require}: MoE router {', '.join(others)} would count pads in the expert-bias "
                "token counts; megatron_ext replaces only Megatron's TopKRouter "
                "(derive a custom router from megatron_ext.moe.router.PaddedTopKRouter)"
            )
    return out


def has_moe_layer(spec: Any) -> bool:
    """Whether ``spec`` holds an MoE layer (a ``MoELayer`` or any ``MoESubmodules``): False for a
    pipeline stage whose layers are all dense."""
    return _contains(spec, MoELayer) or bool(moe_routers(spec))


def moe_routers(spec: Any) -> list[type]:
    """The router class of every ``MoESubmodules`` in ``spec``, in spec order."""
    routers: list[type] = []
    _walk_routers(spec, routers, swap=False)
    return routers


def _is_padded(router: Any) -> bool:
    return isinstance(router, type) and issubclass(router, PaddedTopKRouter)


def _walk_routers(node: Any, routers: list[type], swap: bool) -> Any:
    """Walks a spec, collecting (and with ``swap`` replacing) routers; returns ``node`` itself
    where nothing below it changed."""

    def visit(moe: MoESubmodules) -> MoESubmodules:
        if swap and moe.router is TopKRouter:
            moe = dataclasses.replace(moe, router=PaddedTopKRouter)
        routers.append(moe.router)
        return moe

    return map_moe_submodules(node, visit)


def map_moe_submodules(node: Any, fn: Any) -> Any:
    """``node`` (a layer, block or stack spec) with every ``MoESubmodules`` replaced by ``fn(it)``;
    parts where nothing changed are returned as they are (same objects)."""
    return map_spec(node, lambda part: fn(part) if isinstance(part, MoESubmodules) else part)


def _swap(node: Any, extra: dict[str, Any], found: list[bool]) -> Any:
    """``node`` with every ``MoELayer`` (a partial's func or a ``ModuleSpec``'s module) made an
    ``AlignedMoELayer`` taking ``extra``; ``found`` gets one entry per swap."""

    def swap(part: Any) -> Any:
        if isinstance(part, functools.partial) and part.func is MoELayer:
            found.append(True)
            return functools.partial(AlignedMoELayer, *part.args, **part.keywords, **extra)
        if isinstance(part, ModuleSpec) and part.module is MoELayer:
            found.append(True)
            return dataclasses.replace(
                part, module=AlignedMoELayer, params={**part.params, **extra}
            )
        return part

    return map_spec(node, swap)


def _contains(node: Any, module: type) -> bool:
    """Whether a spec tree holds ``module`` (as a ``ModuleSpec``'s module or a partial's func)."""
    return any(
        part is module or (isinstance(part, functools.partial) and part.func is module)
        for part in spec_parts(node)
    )


def with_grouped_mm_experts(spec: Any) -> Any:
    """``spec`` with every MoE layer's experts replaced by :func:`grouped_mm_experts` (the
    ``torch._grouped_mm`` backend that, like the real fp8/fp4 kernels, refuses unaligned groups):
    the local equivalent of ``--moe-grouped-gemm`` on a machine without Transformer Engine."""
    return map_moe_submodules(
        spec, lambda moe: dataclasses.replace(moe, experts=grouped_mm_experts())
    )


def grouped_mm_experts() -> functools.partial:
    """``TEGroupedMLP`` experts with the ``torch._grouped_mm`` linear backend (no TE needed)."""
    return functools.partial(
        TEGroupedMLP,
        submodules=GroupedMLPSubmodules(linear_fc1=GroupedMMLinear, linear_fc2=GroupedMMLinear),
    )


def _use_grouped_mm_experts(layer_spec: ModuleSpec) -> ModuleSpec:
    moe = layer_spec.submodules.mlp
    assert isinstance(moe, functools.partial) and moe.func is MoELayer, "expected an MoE layer"
    moe_submodules = dataclasses.replace(moe.keywords["submodules"], experts=grouped_mm_experts())
    new_moe = functools.partial(MoELayer, **{**moe.keywords, "submodules": moe_submodules})
    return dataclasses.replace(
        layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=new_moe)
    )


def get_aligned_gpt_layer_local_spec(
    alignment: MoEAlignmentConfig,
    num_experts: int,
    *,
    grouped_mm: bool = False,
    load_metrics: ExpertLoadMetrics | None = None,
) -> ModuleSpec:
    """``GPTModel`` layer spec from local (non-TE) modules with ``AlignedMoELayer`` and
    :class:`PaddedTopKRouter`; ``grouped_mm``: ``TEGroupedMLP`` with the ``torch._grouped_mm``
    backend instead of ``SequentialMLP``."""
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    if grouped_mm:
        spec = _use_grouped_mm_experts(spec)
    return with_aligned_moe(spec, alignment, load_metrics)


class LocalHybridStack(HybridStack):
    """``HybridStack`` whose final norm is a local module instead of TE's ``TENorm``."""

    # Megatron 0.19's HybridStack builds TENorm unconditionally for its final norm: built without
    # it, the local GPT spec's norm added, a HybridModel runs without TE (CPU tests, demo).

    def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
        post_layer_norm = kwargs.pop("post_layer_norm", True)
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            norm = get_gpt_layer_local_spec().submodules.input_layernorm
            if self.config.sequence_parallel:
                from megatron_ext.cpu.local_norms import with_sequence_parallel_norms

                norm = with_sequence_parallel_norms(norm)
            self.final_norm = norm(
                config=self.config,
                hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )


def get_local_hybrid_stack_spec(
    num_experts: int,
    *,
    alignment: MoEAlignmentConfig | None = None,
    grouped_mm: bool = False,
    load_metrics: ExpertLoadMetrics | None = None,
    padded_router: bool = True,
    sequence_parallel: bool = False,
) -> ModuleSpec:
    """A ``HybridStack`` spec from local modules (attention ``*`` and MoE ``E`` layers), for CPU:
    MoE layers ``AlignedMoELayer`` with ``alignment``, else Megatron's ``MoELayer``."""
    # Megatron's stock hybrid_stack_spec needs Transformer Engine; and its torch norms refuse
    # sequence parallelism (sequence_parallel: SequenceParallelTorchNorm instead).
    gpt = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    if grouped_mm:
        gpt = _use_grouped_mm_experts(gpt)
    sub = gpt.submodules
    attention = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=sub.input_layernorm,
            self_attention=sub.self_attention,
            self_attn_bda=sub.self_attn_bda,
        ),
    )
    moe = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=sub.pre_mlp_layernorm, mlp=sub.mlp, mlp_bda=sub.mlp_bda
        ),
    )
    stack = ModuleSpec(
        module=LocalHybridStack,
        submodules=HybridStackSubmodules(attention_layer=attention, moe_layer=moe),
    )
    if sequence_parallel:
        from megatron_ext.cpu.local_norms import with_sequence_parallel_norms

        stack = with_sequence_parallel_norms(stack)
    if alignment is not None:
        stack = with_aligned_moe(stack, alignment, load_metrics, padded_router=False)
    return with_padded_router(stack) if padded_router else stack
