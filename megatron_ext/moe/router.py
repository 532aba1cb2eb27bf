"""``PaddedTopKRouter``: Megatron's ``TopKRouter`` whose expert-bias token counts leave pads out.

Megatron-Core 0.19.2's ``_apply_expert_bias`` masks ``routing_map & ~padding_mask``: ``[N, E]``
against ``[N]`` broadcasts over the wrong dimension and raises at the first training forward, and
megatron_ext always passes a padding mask. Routing ``[[1 0 0] [0 1 0] [0 1 0] [0 0 1]]`` with pads
``[F F T T]`` counts ``[1 1 0]``. Under a capacity factor pads are dropped first
(docs/pad_routing.md); the rest is Megatron's.
"""

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping, get_capacity
from megatron.core.transformer.moe.router import TopKRouter

from megatron_ext.moe.pad_routing import pads_first_keep


def local_count_before_the_reduce(original: Callable[..., Any]) -> Callable[..., Any]:
    """``moe_utils.get_tokens_per_expert_and_token_count`` with a padding mask: this rank's count
    (a compat row for every launch)."""
    # Megatron-Core 0.19.2 sums routing_map into local_tokens_per_expert, all-reduces it in place
    # over TP x CP (reduce_from_tensor_model_parallel_region -> mappings._reduce) and then reads
    # local_num_tokens from it: the group's count. Under --calculate-per-token-loss the router
    # scales the aux loss by local_num_tokens * tp_cp_size, so its gradient came out tp_cp_size
    # times too large under CP (or SP). The aux-loss and z-loss paths otherwise apply the mask
    # with the right shapes (valid[:, None] on [N, E]) and are left as they are.

    @functools.wraps(original)
    def get_tokens_per_expert_and_token_count(
        routing_map: torch.Tensor,
        reduce_group: Any,
        topk: int | None = None,
        with_padding_mask: bool = False,
    ) -> tuple[torch.Tensor, Any, Any]:
        global_per_expert, local_num_tokens, total = original(
            routing_map, reduce_group, topk, with_padding_mask
        )
        if with_padding_mask:  # the local count: routing_map's own sum (no sync)
            local_num_tokens = routing_map.sum() / topk
        return global_per_expert, local_num_tokens, total

    return get_tokens_per_expert_and_token_count


def real_tokens_per_expert(
    routing_map_TE: torch.Tensor, pad_mask_T: torch.Tensor | None
) -> torch.Tensor:
    """Tokens routed to each expert, pads left out (int64 ``[E]``; no host sync); ``pad_mask_T``
    has T elements in the router's token order (None counts every token)."""
    if pad_mask_T is None:
        return routing_map_TE.sum(dim=0)
    # [T, 1] against [T, E]: the mask Megatron meant (its [T] broadcast over experts raises).
    valid_T1 = ~pad_mask_T.reshape(-1, 1).bool()
    assert valid_T1.shape[0] == routing_map_TE.shape[0], (
        f"padding_mask has {valid_T1.shape[0]} tokens, routing map {routing_map_TE.shape[0]}"
    )
    return (routing_map_TE & valid_T1).sum(dim=0)


class PaddedTopKRouter(TopKRouter):
    """``TopKRouter`` whose expert-bias counts (``local_tokens_per_expert``) exclude pads and whose
    capacity dropping drops pads first; it reaches a model through the spec
    (:func:`megatron_ext.moe.layer_specs.with_padded_router`)."""

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False) -> None:
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.capacity_factor = config.moe_expert_capacity_factor
        self._bias_deferred = False
        if self.capacity_factor is not None:
            # Megatron's routing() reads the factor from the config in one place, to drop tokens
            # between top-k and the aux losses; this router drops after it (pads first), so it keeps
            # a copy of the config without the factor. The MoE layer and dispatcher keep theirs.
            self.config = copy.copy(config)
            self.config.moe_expert_capacity_factor = None

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """Megatron's routing; under a capacity factor, then its token dropping with pads first."""
        # Dropping after Megatron's aux losses are attached gives the same values and gradients
        # as before (they are computed from the logits; attaching is an identity on the probs).
        # The expert-bias counts are taken after dropping, as Megatron does.
        if self.capacity_factor is None:
            return super().routing(logits, padding_mask)
        self._bias_deferred = True
        try:
            probs, routing_map = super().routing(logits, padding_mask)
        finally:
            self._bias_deferred = False
        probs, routing_map = self._drop_pads_first(probs, routing_map, padding_mask)
        self._apply_expert_bias(routing_map, padding_mask)
        return probs, routing_map

    def _drop_pads_first(
        self, probs_TE: torch.Tensor, routing_map_TE: torch.Tensor, pad: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron's ``apply_router_token_dropping`` among real tokens; pads take what is left."""
        # Megatron ranks pads and real tokens together: a pad could keep a slot while a real token
        # is dropped. Among real tokens alone it is exactly Megatron's result without pads.
        pad_to_capacity = self.config.moe_pad_expert_input_to_capacity
        drop = functools.partial(
            apply_router_token_dropping,
            router_topk=self.topk,
            capacity_factor=self.capacity_factor,
            drop_policy=self.config.moe_token_drop_policy,
            pad_to_capacity=pad_to_capacity,
        )
        if pad is None:
            return drop(probs_TE, routing_map_TE)
        pad_T1 = pad.reshape(-1, 1).bool()
        kept_probs_TE, kept_TE = drop(probs_TE.masked_fill(pad_T1, 0.0), routing_map_TE & ~pad_T1)
        if pad_to_capacity:  # every slot is filled; pads may be fillers, at probability 0
            return kept_probs_TE, kept_TE
        num_tokens, num_experts = routing_map_TE.shape
        capacity = get_capacity(
            num_tokens=num_tokens * self.topk,
            num_experts=num_experts,
            capacity_factor=self.capacity_factor,
        )
        kept_TE = kept_TE | pads_first_keep(
            kept_TE, routing_map_TE, probs_TE, pad, capacity, self.config.moe_token_drop_policy
        )
        return probs_TE * kept_TE, kept_TE

    def _apply_expert_bias(
        self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> None:
        """Adds this micro-batch's real-token counts to ``local_tokens_per_expert``."""
        # Not under Megatron's jit_fuser: two element-wise ops and a sum, nothing to fuse.
        if self._bias_deferred:  # under a capacity factor: after the dropping (routing)
            return
        # Megatron's gate: expert bias on and grad enabled (a training forward or a checkpoint's
        # recompute; Megatron evaluates under no_grad).
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += real_tokens_per_expert(routing_map, padding_mask)
