"""``PaddedTopKRouter``: Megatron's ``TopKRouter`` whose expert-bias token counts leave pads out.

Aux-loss-free balancing (``--moe-router-enable-expert-bias``, DeepSeek-V3) counts the tokens each
expert received in ``local_tokens_per_expert``; Megatron's ``finalize_model_grads`` turns those
counts into the next step's expert bias. megatron_ext always hands the router a ``padding_mask``
(True = pad) so pads stay out of the balancing statistics, but Megatron-Core 0.19.2's
``TopKRouter._apply_expert_bias`` masks with ``routing_map & ~padding_mask``: ``[N, E]`` against
``[N]``, which broadcasts over the wrong dimension and raises at the first training forward. This
subclass counts ``routing_map & ~padding_mask[:, None]``, so only real tokens are counted.

Worked example (N=4 tokens, E=3 experts, top-1; the last two tokens are pads)::

    routing_map = [[1 0 0]      padding_mask = [F F T T]
                   [0 1 0]
                   [0 1 0]       counted:  [1 1 0]   (Megatron without the mask: [1 2 1])
                   [0 0 1]]

Everything else is Megatron's: top-k, scores, aux losses, z-loss, token dropping and route
replay (``RouterReplay`` lives on the router and is inherited), and ``local_tokens_per_expert``
keeps Megatron's shape, dtype and "training forward with grad only" rule (no count in evaluation
or in the ``no_grad`` first pass of an activation checkpoint). Without a padding mask, or with
expert bias off, the router is ``TopKRouter`` exactly. It reaches a model through the spec
(``MoESubmodules.router``; see :func:`megatron_ext.moe.layer_specs.with_padded_router`).

Under a capacity factor (``--moe-expert-capacity-factor``) Megatron's token dropping ranks pads and real
tokens together, so a pad can keep an expert slot while a real token is dropped. This router drops pads
first, under both drop policies: Megatron's own ``apply_router_token_dropping`` chooses among the real
tokens alone (exactly Megatron's result when there are no pads), and pads get only the slots real tokens
left free (:func:`megatron_ext.moe.pad_routing.pads_first_keep`). With capacity padding
(``--moe-pad-expert-input-to-capacity``) Megatron's filler slots carry pads at probability 0.

The aux-loss paths of 0.19.2 (``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``) and the z-loss
already apply the flattened mask with the right shapes (``valid[:, None]`` on ``[N, E]``, ``[N]`` on
``[N]``), so they are left as they are, but for one count: with a padding mask, Megatron's
``get_tokens_per_expert_and_token_count`` reads this rank's real-token count after an in-place
all-reduce over the TP x CP group, so under context parallelism (or SP) the per-token-loss aux-loss
gradient is scaled by the group's whole count, CP (TP) times too much
(:func:`local_count_before_the_reduce`, a compat row for every launch).
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
    """``moe_utils.get_tokens_per_expert_and_token_count`` with a padding mask: this rank's count.

    Megatron-Core 0.19.2 sums ``routing_map`` into ``local_tokens_per_expert``, all-reduces it over the
    TP x CP group with ``reduce_from_tensor_model_parallel_region`` (in place on a contiguous tensor:
    ``mappings._reduce``) and then reads ``local_num_tokens`` from it: the group's count, not this
    rank's. Under ``--calculate-per-token-loss`` the router scales the aux loss by
    ``local_num_tokens * tp_cp_size`` to cancel the per-token normalisation, so the aux-loss
    gradient came out ``tp_cp_size`` times too large under CP (or SP) with a padding mask, which
    megatron_ext always passes. The local count is ``routing_map``'s own sum (no sync).
    """

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
        if with_padding_mask:
            local_num_tokens = routing_map.sum() / topk
        return global_per_expert, local_num_tokens, total

    return get_tokens_per_expert_and_token_count


def real_tokens_per_expert(
    routing_map_TE: torch.Tensor, pad_mask_T: torch.Tensor | None
) -> torch.Tensor:
    """Tokens routed to each expert, pads left out (int64 ``[E]``; no host sync).

    Args:
        routing_map_TE: bool ``[T, E]``, the router's output routing map.
        pad_mask_T: ``[T]`` (any shape with T elements, in the router's token order), True = pad;
            None counts every token.
    """
    if pad_mask_T is None:
        return routing_map_TE.sum(dim=0)
    valid_T1 = ~pad_mask_T.reshape(-1, 1).bool()
    assert valid_T1.shape[0] == routing_map_TE.shape[0], (
        f"padding_mask has {valid_T1.shape[0]} tokens, routing map {routing_map_TE.shape[0]}"
    )
    return (routing_map_TE & valid_T1).sum(dim=0)


class PaddedTopKRouter(TopKRouter):
    """``TopKRouter`` whose expert-bias counts (``local_tokens_per_expert``) exclude pads and whose
    capacity dropping drops pads first."""

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
        """Megatron's routing; under a capacity factor, then its token dropping with pads first.

        Dropping after Megatron's aux losses are attached gives the same values and gradients as
        dropping before (the aux losses are computed from the logits, and attaching is an identity
        on the probabilities); the expert-bias counts are taken after dropping, as Megatron does.
        """
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
        """Adds this micro-batch's real-token counts to ``local_tokens_per_expert``.

        Same gate as Megatron's: only with expert bias on and grad enabled (a training forward
        or the recompute of a checkpoint; Megatron evaluates under ``no_grad``). Not wrapped in
        Megatron's ``jit_fuser``: two element-wise ops and a sum, nothing to fuse. Under a capacity
        factor the count waits for the dropping (see :meth:`routing`).
        """
        if self._bias_deferred:
            return
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += real_tokens_per_expert(routing_map, padding_mask)
