"""``AlignedMoELayer``: Megatron's ``MoELayer`` with megatron_ext's aligning token dispatcher.

Megatron-Core 0.19 picks the dispatcher by a string inside ``MoELayer.__init__``, so the seam is a
subclass: it builds the stock layer, then swaps in the aligning subclass of the same dispatcher
and tells the experts that groups arrive aligned, so nothing pads twice. Specs get it through
:func:`megatron_ext.moe.layer_specs.with_aligned_moe`.
"""

import logging
from typing import Any

import torch
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.data.quantization_align import megatron_align_size
from megatron_ext.moe.config import MoEAlignmentConfig, align_size_for_config
from megatron_ext.moe.load_metrics import ExpertLoadMetrics
from megatron_ext.moe.pad_routing import PadRouting, clear_pad_routes
from megatron_ext.moe.pad_skip_dispatcher import SkipPadRowsMixin, skip_pad_rows_dispatcher
from megatron_ext.moe.token_dispatcher import (
    AlignedAllGatherTokenDispatcher,
    AlignedAlltoAllTokenDispatcher,
)

logger = logging.getLogger(__name__)

_ALIGNED_DISPATCHERS = {
    "alltoall": AlignedAlltoAllTokenDispatcher,
    "allgather": AlignedAllGatherTokenDispatcher,
}


class AlreadyAlignedPadding(torch.nn.Module):
    """Stands in for TE's ``Fp8Padding`` while the dispatcher aligns every group: checks the host
    split sizes (free) against our multiple and Megatron's; inactive, defers to ``fallback``."""

    def __init__(
        self, aligner: Any, config: TransformerConfig, fallback: torch.nn.Module | None = None
    ) -> None:
        super().__init__()
        self.aligner = aligner
        self.config = config  # the experts' config: the precision their GEMMs run in now
        self.fallback = fallback

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, list[int]]:
        if not self.aligner.active:
            # Refused without a fallback, rather than let unaligned groups reach a quantized GEMM.
            if self.fallback is None:
                raise ValueError(
                    "AlignedMoELayer: the experts run a quantized GEMM but --moe-dispatch-align "
                    "is inactive for this precision and no expert padding exists to fall back to"
                )
            return self.fallback(x, m_splits)
        config = self.config
        required = megatron_align_size(config) if (config.fp8 or config.fp4) else 0
        for align in (self.aligner.align, required):
            bad = [(i, n) for i, n in enumerate(m_splits) if n % max(align, 1)]
            assert not bad, f"unaligned groups for multiple {align} (expert, rows): {bad}"
        return x, m_splits


class AlreadyAlignedUnpadding(torch.nn.Module):
    """Stands in for TE's ``Fp8Unpadding``: the dispatcher strips the pads itself (inactive, it
    defers to the unpadding it replaced)."""

    def __init__(self, aligner: Any, fallback: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.aligner = aligner
        self.fallback = fallback

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        if not self.aligner.active and self.fallback is not None:
            return self.fallback(x, m_splits)
        return x


def tell_experts_groups_are_aligned(experts: torch.nn.Module, aligner: Any) -> None:
    """Stops Megatron's experts from padding groups the dispatcher already aligned."""
    # TEGroupedMLP builds its Fp8Padding pair only under fp8/fp4. The stand-ins go in when the
    # aligner is active, or when the experts have no padding to lose (a bf16 build: the stand-in
    # then refuses unaligned use); TE's own padding stays otherwise. Flex (HybridEP) is not
    # swapped: it pads inside its dispatch (_pass_multiple_to_flex).
    if not isinstance(experts, TEGroupedMLP):
        return  # SequentialMLP pads each group to the same multiple: 0 rows once aligned.
    padding = getattr(experts, "quantization_padding", None)
    unpadding = getattr(experts, "quantization_unpadding", None)
    if padding is not None and not aligner.active:
        return
    experts.quantization_padding = AlreadyAlignedPadding(aligner, experts.config, padding)
    experts.quantization_unpadding = AlreadyAlignedUnpadding(aligner, unpadding)


class AlignedMoELayer(MoELayer):
    """``MoELayer`` whose token dispatcher aligns expert groups (``alignment``), whose pads can
    skip dispatch (``pad_routing``; None: routed like text), and which optionally records its
    load (``load_metrics``)."""

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
        pad_routing: PadRouting | None = None,
    ) -> None:
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        self._check(config, alignment, pad_routing)
        super().__init__(config, submodules, layer_number, pg_collection, is_mtp_layer, name)
        self.alignment = alignment
        # The group multiple, decided once here and passed down (realign() for a new precision).
        self.align = align_size_for_config(config, alignment)
        self.load_metrics = load_metrics
        self.pad_routing = pad_routing
        dispatcher_type = config.moe_token_dispatcher_type
        if alignment.moe_dispatch_align and dispatcher_type == "flex":
            self._pass_multiple_to_flex()
            return
        aligned = alignment.moe_dispatch_align
        # allgather needs no change to skip pads: it sizes its permute from the routing map.
        skip_rows = self.skips_pads and dispatcher_type == "alltoall"
        if not (aligned or skip_rows):
            return
        if aligned:
            cls = _ALIGNED_DISPATCHERS[dispatcher_type]
            extra = {"alignment": alignment, "align": self.align}
        else:
            cls, extra = MoEAlltoAllTokenDispatcher, {}
        if skip_rows:
            cls = skip_pad_rows_dispatcher(cls)
        dispatcher = cls(
            self.num_local_experts,
            self.local_expert_indices,
            config=self.config,
            pg_collection=pg_collection,
            **extra,
        )
        if self.use_shared_expert and self.shared_expert_overlap:
            dispatcher.set_shared_experts(self.shared_experts)
        self.token_dispatcher = dispatcher
        if hasattr(self, "_training_token_dispatcher"):
            self._training_token_dispatcher = dispatcher
        if aligned:
            tell_experts_groups_are_aligned(self.experts, dispatcher.aligner)

    @property
    def skips_pads(self) -> bool:
        """Whether pads' routes are cleared before dispatch (``--moe-pad-routing skip``)."""
        return self.pad_routing is not None and self.pad_routing.skip

    def realign(self, config: TransformerConfig | None = None) -> int:
        """Re-decides the group multiple after a caller changed the fp8/fp4 settings of a built
        layer (a benchmark, the CPU rehearsal of a quantized run), passes it down and returns it.
        ``config``: the changed config (default: the layer's own)."""
        self.align = align_size_for_config(config or self.config, self.alignment)
        aligner = getattr(self.token_dispatcher, "aligner", None)
        if aligner is not None:
            aligner.align = self.align
        return self.align

    @staticmethod
    def _check(
        config: TransformerConfig, alignment: MoEAlignmentConfig, pad_routing: PadRouting | None
    ) -> None:
        if pad_routing is not None and pad_routing.skip:
            if config.moe_token_dispatcher_type not in ("alltoall", "allgather"):
                raise ValueError(
                    "--moe-pad-routing skip supports --moe-token-dispatcher-type alltoall or "
                    f"allgather, got {config.moe_token_dispatcher_type!r}"
                )
            if config.moe_pad_expert_input_to_capacity:
                raise ValueError(
                    "--moe-pad-routing skip cannot be combined with "
                    "--moe-pad-expert-input-to-capacity"
                )
        if not alignment.moe_dispatch_align:
            return
        # What pretrain_gpt refuses at argument time, refused here for a model built from a spec
        # in a user's own script (the config carries the same names as Megatron's arguments).
        alignment.refuse_unalignable(config)
        if config.moe_token_dispatcher_type not in (*_ALIGNED_DISPATCHERS, "flex"):
            raise ValueError(
                "--moe-dispatch-align supports --moe-token-dispatcher-type alltoall, allgather "
                f"or flex, got {config.moe_token_dispatcher_type!r}"
            )

    def _pass_multiple_to_flex(self) -> None:
        """HybridEP pads inside its dispatch with ``pad_multiple``; hand it ours (GPU only)."""
        # Under fp8/fp4 Megatron re-derives the same multiple from the recipe at every dispatch
        # (check_megatron_args refuses an override that differs); under bf16 it is 0 and nothing
        # is passed. DeepEP / NCCL-EP align through Megatron's own recipe-derived size.
        manager = getattr(self.token_dispatcher, "_comm_manager", None)
        if manager is not None and hasattr(manager, "pad_multiple") and self.align > 1:
            manager.pad_multiple = self.align

    def route(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """Megatron's routing (and replay), then in skip mode pads' routes cleared (no all-to-all
        row, no expert); recorded into the load tracker when one is attached (pads then count 0)."""
        probs, routing_map = super().route(hidden_states, padding_mask)
        real_tokens = None
        if self.skips_pads and padding_mask is not None:
            real_tokens = self.pad_routing.real_tokens(padding_mask, self.layer_number)
        if real_tokens is not None:
            probs, routing_map = clear_pad_routes(probs, routing_map, padding_mask)
            if isinstance(self.token_dispatcher, SkipPadRowsMixin):
                self.token_dispatcher.real_tokens = real_tokens
        # Training forwards only: a recompute or an evaluation does not count a micro-batch again.
        if self.load_metrics is not None and self.load_metrics.counts_pass(self):
            pad_mask_T = None if padding_mask is None else padding_mask.reshape(-1)
            self.load_metrics.record(self.layer_number, routing_map, pad_mask_T)
        return probs, routing_map
