"""All-to-all token dispatchers whose permute is sized for real tokens only (``--moe-pad-routing skip``).

Megatron-Core 0.19.2's dropless ``MoEAlltoAllTokenDispatcher.preprocess`` sets the permute output size to
``N * topk`` on the host, without reading the device. With pads' rows cleared from the routing map
(:func:`megatron_ext.moe.pad_routing.clear_pad_routes`) only ``(N - pads) * topk`` rows exist; the MoE
layer hands the dispatcher the real-token count it got from the host (``real_tokens``) before dispatch,
and :class:`SkipPadRowsMixin` lowers ``num_out_tokens`` to it. Everything else is the dispatcher's own:
the all-to-all splits and the experts' group sizes already come from the routing map's sums, so pads
send no row and reach no expert. The all-gather dispatcher reads its sizes from the routing map
(``tokens_per_expert.sum().item()`` in Megatron), so it needs no change; its all-gather still carries
every token's hidden state (equal-sized per rank), but pads reach no expert GEMM.

Example::

    cls = skip_pad_rows_dispatcher(AlignedAlltoAllTokenDispatcher)   # or Megatron's own
    dispatcher = cls(num_local_experts, local_expert_indices, config=config, ...)
    dispatcher.real_tokens = 37        # set by AlignedMoELayer.route for this micro-batch
"""

import functools

import torch


class SkipPadRowsMixin:
    """Lowers a dropless all-to-all's permute size to the real rows (place before the dispatcher)."""

    #: Real tokens among this dispatch's router rows (host int), set by the MoE layer; None: all.
    real_tokens: int | None = None

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Megatron's preprocess; then, when dropless, ``num_out_tokens = real tokens * topk``."""
        tokens_per_local_expert = super().preprocess(routing_map)  # type: ignore[misc]
        real, self.real_tokens = self.real_tokens, None
        dropless = isinstance(self.num_out_tokens, int) and not self.drop_and_pad
        if real is not None and dropless:
            assert real <= routing_map.size(0), "more real tokens than router rows"
            self.num_out_tokens = real * self.config.moe_router_topk
        return tokens_per_local_expert


@functools.cache
def skip_pad_rows_dispatcher(base: type) -> type:
    """``base`` (an all-to-all dispatcher class) with :class:`SkipPadRowsMixin` in front."""
    return type(f"SkipPadRows{base.__name__}", (SkipPadRowsMixin, base), {})
