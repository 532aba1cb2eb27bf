"""All-to-all token dispatchers whose permute is sized for real tokens only (``--moe-pad-routing skip``).

Megatron-Core 0.19.2's dropless ``MoEAlltoAllTokenDispatcher.preprocess`` sizes its permute output
``N * topk`` on the host; with pads' rows cleared only ``(N - pads) * topk`` rows exist, a count
``AlignedMoELayer.route`` sets as ``dispatcher.real_tokens`` from the host before dispatch.
"""

import functools

import torch


class SkipPadRowsMixin:
    """Lowers a dropless all-to-all's permute size to the real rows (place before the dispatcher)."""

    #: Real tokens among this dispatch's router rows (host int), set by the MoE layer; None: all.
    real_tokens: int | None = None

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Megatron's preprocess; then, when dropless, ``num_out_tokens = real tokens * topk``."""
        # Everything else is the dispatcher's own: the all-to-all splits and the experts' group
        # sizes come from the routing map's sums, so pads send no row. (The all-gather dispatcher
        # sizes from the routing map too: it needs no change.)
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
