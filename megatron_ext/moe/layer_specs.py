"""Layer-spec functions that switch Megatron models onto :class:`AlignedMoELayer`.

Megatron-Core 0.19 has two MoE model classes: ``GPTModel`` (deprecated in 0.19, used by most runs;
one layer spec) and ``HybridModel`` (its successor; a ``HybridStack`` spec plus a layer pattern
such as ``"*E*E"``). Both reach ``MoELayer`` through a ``functools.partial(MoELayer, ...)`` or a
``ModuleSpec(module=MoELayer)`` inside the spec; :func:`with_aligned_moe` swaps that for
``AlignedMoELayer`` wherever it sits, so it works on any spec, stock or custom.

Example::

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
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron_ext.config import MoEAlignmentConfig
from megatron_ext.moe.grouped_mm_linear import GroupedMMLinear
from megatron_ext.moe.load_metrics import ExpertLoadMetrics
from megatron_ext.moe.moe_layer import AlignedMoELayer


def with_aligned_moe(
    spec: Any, alignment: MoEAlignmentConfig, load_metrics: ExpertLoadMetrics | None = None
) -> Any:
    """Returns a copy of ``spec`` with every ``MoELayer`` replaced by ``AlignedMoELayer``.

    Args:
        spec: A layer spec, block spec or stack spec (``ModuleSpec``, partial or dataclass).
        alignment: megatron_ext's MoE config.
        load_metrics: Optional tracker every MoE layer records into.

    Raises:
        ValueError: ``spec`` contains no ``MoELayer`` (nothing would be aligned).
    """
    found: list[bool] = []
    out = _swap(spec, alignment, load_metrics, found)
    if not found:
        raise ValueError("with_aligned_moe: the spec contains no MoELayer to align")
    return out


def _swap(node: Any, alignment: Any, load_metrics: Any, found: list[bool]) -> Any:
    extra = {"alignment": alignment, "load_metrics": load_metrics}
    if isinstance(node, functools.partial) and node.func is MoELayer:
        found.append(True)
        return functools.partial(AlignedMoELayer, *node.args, **node.keywords, **extra)
    if isinstance(node, ModuleSpec):
        if node.module is MoELayer:
            found.append(True)
            return dataclasses.replace(
                node, module=AlignedMoELayer, params={**node.params, **extra}
            )
        if node.submodules is None:
            return node
        return dataclasses.replace(
            node, submodules=_swap(node.submodules, alignment, load_metrics, found)
        )
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {
            f.name: _swap(getattr(node, f.name), alignment, load_metrics, found)
            for f in dataclasses.fields(node)
            if f.init
        }
        return dataclasses.replace(node, **changes)
    if isinstance(node, list):
        return [_swap(n, alignment, load_metrics, found) for n in node]
    return node


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
    """``GPTModel`` layer spec from local (non-TE) modules with ``AlignedMoELayer``.

    Args:
        alignment: megatron_ext's MoE config.
        num_experts: Number of routed experts.
        grouped_mm: Use ``TEGroupedMLP`` with the ``torch._grouped_mm`` backend instead of
            ``SequentialMLP``.
        load_metrics: Optional load tracker.
    """
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    if grouped_mm:
        spec = _use_grouped_mm_experts(spec)
    return with_aligned_moe(spec, alignment, load_metrics)


class LocalHybridStack(HybridStack):
    """``HybridStack`` whose final norm is a local module instead of TE's ``TENorm``.

    Megatron 0.19's ``HybridStack`` builds ``TENorm`` unconditionally for its final norm; this
    subclass builds the stack without it and adds the norm of the local GPT spec instead, so a
    ``HybridModel`` runs without Transformer Engine (CPU tests, demo).
    """

    def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
        post_layer_norm = kwargs.pop("post_layer_norm", True)
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            norm = get_gpt_layer_local_spec().submodules.input_layernorm
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
) -> ModuleSpec:
    """A ``HybridStack`` spec from local modules (attention ``*`` and MoE ``E`` layers).

    Megatron's stock ``hybrid_stack_spec`` needs Transformer Engine; this one runs on CPU. With
    ``alignment`` its MoE layers are ``AlignedMoELayer``; without, Megatron's ``MoELayer``.
    """
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
    return stack if alignment is None else with_aligned_moe(stack, alignment, load_metrics)
