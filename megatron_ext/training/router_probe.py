"""Observes the routing decisions of every Megatron ``TopKRouter`` in a model, without changing them.

Used by the demo and benchmarks to count tokens per expert and per expert-parallel rank. Counts stay on the
device as tensors; they are reduced over ranks and read only when the caller asks (at logging time).

Example::

    with RouterProbe(model) as probe:
        model(tokens, position_ids, attention_mask=None)
    probe.tokens_per_expert()        # [L, E] summed over this rank's tokens
    probe.tokens_per_ep_rank(ep=2)   # [L, 2] summed over all ranks (one all-reduce)
"""

from typing import Any, Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter


class RouterProbe:
    """Forward hooks on each ``TopKRouter`` that accumulate its ``routing_map`` per expert.

    Args:
        model: Any module containing Megatron MoE layers.
        pad_mask: Optional ``[b, s]`` bool (True = pad) for the next forward; set per batch with
            :meth:`set_pad_mask`. Pad tokens are then also counted separately.
    """

    def __init__(self, model: torch.nn.Module, pad_mask: Optional[torch.Tensor] = None) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not self.routers:
            raise ValueError("RouterProbe: the model has no MoE layer (no TopKRouter found)")
        self.pad_mask = pad_mask
        self.counts_LE: Optional[torch.Tensor] = None
        self.pad_counts_LE: Optional[torch.Tensor] = None
        self._handles: list[Any] = []

    def set_pad_mask(self, pad_mask: Optional[torch.Tensor]) -> None:
        """Pad mask ``[b, s]`` (True = pad) of the batch about to run forward."""
        self.pad_mask = pad_mask

    def __enter__(self) -> "RouterProbe":
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            routing_map_TE = output[1].detach()
            num_layers, num_experts = len(self.routers), routing_map_TE.shape[-1]
            if self.counts_LE is None:
                self.counts_LE = torch.zeros(num_layers, num_experts, dtype=torch.long)
                self.pad_counts_LE = torch.zeros_like(self.counts_LE)
            self.counts_LE[layer] += routing_map_TE.sum(0).to(torch.long)
            if self.pad_mask is not None:
                # Megatron's router sees tokens as [s, b] flattened; the pad mask is [b, s].
                pad_T = self.pad_mask.transpose(0, 1).reshape(-1).to(routing_map_TE.device)
                if pad_T.numel() == routing_map_TE.shape[0]:
                    pads_TE = routing_map_TE & pad_T.unsqueeze(1)
                    self.pad_counts_LE[layer] += pads_TE.sum(0).to(torch.long)

        return hook

    def tokens_per_expert(self, include_pads: bool = True) -> torch.Tensor:
        """``[L, E]`` routed token slots per expert from this rank's tokens."""
        if self.counts_LE is None:
            raise ValueError("RouterProbe: no forward pass has run inside the probe")
        return self.counts_LE if include_pads else self.counts_LE - self.pad_counts_LE

    def global_tokens_per_expert(self, include_pads: bool = True) -> torch.Tensor:
        """``[L, E]`` summed over all ranks (one all-reduce when torch.distributed is up)."""
        counts_LE = self.tokens_per_expert(include_pads).clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts_LE)
        return counts_LE

    def tokens_per_ep_rank(self, ep: int, include_pads: bool = True) -> torch.Tensor:
        """``[L, ep]`` token slots each expert-parallel rank receives (experts split evenly, in order)."""
        counts_LE = self.global_tokens_per_expert(include_pads)
        num_layers, num_experts = counts_LE.shape
        if num_experts % ep:
            raise ValueError(f"ep={ep} does not divide the {num_experts} experts")
        return counts_LE.view(num_layers, ep, num_experts // ep).sum(-1)


def peak_over_mean(counts: torch.Tensor) -> float:
    """``max / mean`` over the last dimension, worst over the others (1.0 = perfectly balanced)."""
    counts = counts.to(torch.float64)
    return float((counts.max(-1).values / counts.mean(-1).clamp_min(1e-12)).max())
