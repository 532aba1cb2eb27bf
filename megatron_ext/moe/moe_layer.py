"""``AlignedMoELayer``: Megatron's ``MoELayer`` with megatron_ext's aligning token dispatcher.

Megatron-Core 0.19 picks the dispatcher by a string inside ``MoELayer.__init__``, so the seam is a
subclass: it builds the stock layer, then swaps in :mod:`megatron_ext.moe.token_dispatcher`'s
subclass of the same dispatcher and tells the experts that groups arrive aligned, so nothing pads
twice:

- ``TEGroupedMLP``: its ``Fp8Padding``/``Fp8Unpadding`` pair (and its ``tolist``-then-pad path)
  is replaced by a pass-through that checks the host split sizes it already has;
- ``SequentialMLP``: pads each group to the same multiple, which is now a no-op (0 rows).
- flex (HybridEP): no swap; HybridEP pads inside its dispatch and Megatron already hands it
  ``pad_multiple``; an override of the multiple is passed as that ``pad_multiple`` (GPU only).

Example::

    spec = get_gpt_layer_local_spec(num_experts=8)            # or a HybridStack spec
    spec = with_aligned_moe(spec, MoEAlignmentConfig(moe_dispatch_align=True))
    # every MoELayer in it is now an AlignedMoELayer (see megatron_ext.moe.layer_specs)
"""

import logging
from typing import Any

import torch
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.config import MoEAlignmentConfig
from megatron_ext.moe.load_metrics import ExpertLoadMetrics
from megatron_ext.moe.token_dispatcher import (
    AlignedAllGatherTokenDispatcher,
    AlignedAlltoAllTokenDispatcher,
    align_size_for_config,
)

logger = logging.getLogger(__name__)

_ALIGNED_DISPATCHERS = {
    "alltoall": AlignedAlltoAllTokenDispatcher,
    "allgather": AlignedAllGatherTokenDispatcher,
}


class AlreadyAlignedPadding(torch.nn.Module):
    """Stands in for TE's ``Fp8Padding`` when the dispatcher already aligned every group.

    Takes and returns ``(rows, split sizes)`` like ``Fp8Padding``; the split sizes are a host list
    there, so the check is free.
    """

    def __init__(self, aligner: Any) -> None:
        super().__init__()
        self.aligner = aligner

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, list[int]]:
        align = max(self.aligner.align, 1)
        bad = [(i, n) for i, n in enumerate(m_splits) if n % align]
        assert not bad, f"dispatcher delivered unaligned groups (expert, rows): {bad}"
        return x, m_splits


class AlreadyAlignedUnpadding(torch.nn.Module):
    """Stands in for TE's ``Fp8Unpadding``: the dispatcher strips the pads itself."""

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        del m_splits
        return x


def tell_experts_groups_are_aligned(experts: torch.nn.Module, aligner: Any) -> None:
    """Stops Megatron's experts from padding groups the dispatcher already aligned."""
    if isinstance(experts, TEGroupedMLP):
        experts.quantization_padding = AlreadyAlignedPadding(aligner)
        experts.quantization_unpadding = AlreadyAlignedUnpadding()
    # SequentialMLP pads each group to the same multiple: 0 rows once groups are aligned.


class AlignedMoELayer(MoELayer):
    """``MoELayer`` whose token dispatcher aligns expert groups (and optionally logs load).

    Args:
        config, submodules, layer_number, pg_collection, is_mtp_layer, name: As ``MoELayer``.
        alignment: megatron_ext's MoE config (``--moe-dispatch-align`` and friends).
        load_metrics: Optional tracker recording this layer's routing (``--moe-expert-load-metrics``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Any = None,
        layer_number: int | None = None,
        pg_collection: Any = None,
        is_mtp_layer: bool = False,
        name: str | None = None,
        *,
        alignment: MoEAlignmentConfig,
        load_metrics: ExpertLoadMetrics | None = None,
    ) -> None:
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        self._check(config, alignment)
        super().__init__(config, submodules, layer_number, pg_collection, is_mtp_layer, name)
        self.alignment = alignment
        self.load_metrics = load_metrics
        dispatcher_type = config.moe_token_dispatcher_type
        if not alignment.moe_dispatch_align:
            return
        if dispatcher_type == "flex":
            self._pass_multiple_to_flex()
            return
        dispatcher = _ALIGNED_DISPATCHERS[dispatcher_type](
            self.num_local_experts,
            self.local_expert_indices,
            config=self.config,
            pg_collection=pg_collection,
            alignment=alignment,
        )
        if self.use_shared_expert and self.shared_expert_overlap:
            dispatcher.set_shared_experts(self.shared_experts)
        self.token_dispatcher = dispatcher
        if hasattr(self, "_training_token_dispatcher"):
            self._training_token_dispatcher = dispatcher
        tell_experts_groups_are_aligned(self.experts, dispatcher.aligner)

    @property
    def align(self) -> int:
        """The group multiple for the config's current precision (0: none)."""
        return align_size_for_config(self.config, self.alignment)

    @staticmethod
    def _check(config: TransformerConfig, alignment: MoEAlignmentConfig) -> None:
        if not alignment.moe_dispatch_align:
            return
        if config.moe_router_padding_for_quantization:
            raise ValueError(
                "--moe-dispatch-align and --moe-router-padding-for-quantization both pad expert "
                "groups; use only --moe-dispatch-align"
            )
        if config.moe_token_dispatcher_type not in (*_ALIGNED_DISPATCHERS, "flex"):
            raise ValueError(
                "--moe-dispatch-align supports --moe-token-dispatcher-type alltoall, allgather "
                f"or flex, got {config.moe_token_dispatcher_type!r}"
            )

    def _pass_multiple_to_flex(self) -> None:
        """HybridEP pads inside its dispatch with ``pad_multiple``; hand it ours (GPU only).

        Under fp8/fp4 Megatron re-derives the same multiple from the recipe at every dispatch
        (``check_megatron_args`` refuses an override that differs); under bf16 our override is
        the only source. DeepEP / NCCL-EP align through Megatron's own recipe-derived size.
        """
        manager = getattr(self.token_dispatcher, "_comm_manager", None)
        if manager is not None and hasattr(manager, "pad_multiple") and self.align > 1:
            manager.pad_multiple = self.align

    def route(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """Megatron's routing, recorded into the load tracker when one is attached."""
        probs, routing_map = super().route(hidden_states, padding_mask)
        if self.load_metrics is not None:
            pad_mask_T = None if padding_mask is None else padding_mask.reshape(-1)
            self.load_metrics.record(self.layer_number, routing_map, pad_mask_T)
        return probs, routing_map
