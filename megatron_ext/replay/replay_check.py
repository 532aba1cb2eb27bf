"""Verifies route replay inside the training loop: did Megatron's routers use the replayed routes?

With ``--route-replay-check``, every training forward of a replaying MoE router is compared, on the
device, with what was installed for it: ``matched`` counts (token, layer) rows whose routing map holds
exactly the replayed top-k experts, ``natural_differs`` the rows where the router's own top-k of the
same scores (computed once more, for this diagnostic only) would have chosen another set. Both are
device counters; they are read (one device-to-host copy) only when Megatron logs.

Example (what the loop prints at a log iteration)::

    megatron_ext replay check: 4096/4096 (token, layer) routes replayed exactly; the model's own
    router would have chosen differently on 3530 (86.2%)
"""

from collections.abc import Callable
from typing import Any

import torch


class ReplayCheck:
    """Device counters of replayed (token, layer) rows, filled by router hooks."""

    def __init__(self) -> None:
        self.counts = torch.zeros(3, dtype=torch.long)  # rows, matched, natural_differs
        self._pending: tuple[int, torch.Tensor] | None = None
        self._hooks: list[Any] = []

    def attach(self, binding: Any) -> None:
        """Hooks every router ``binding`` replays into (forward hooks: no change to routing)."""
        from megatron.core.transformer.moe.router import TopKRouter

        for router, _ in binding._restore:  # (router, previous RouterReplay) pairs
            assert isinstance(router, TopKRouter)
            self._hooks.append(router.register_forward_hook(self._compare))
        binding.on_replay = self._observe

    def _observe(
        self,
        ordinal: int,
        scores_NE: torch.Tensor,
        idx_NK: torch.Tensor,
        natural: Callable[[], torch.Tensor],
    ) -> None:
        """Called by the binding with the indices it replays (training forwards only)."""
        natural_NK = natural()
        same = _same_sets(natural_NK, idx_NK, scores_NE.shape[-1])
        self.counts = self.counts.to(idx_NK.device)
        self.counts[2] += (~same).sum()
        self._pending = (ordinal, idx_NK)

    def _compare(self, router: torch.nn.Module, args: Any, output: Any) -> None:
        del router, args
        pending = self._pending
        if pending is None or not torch.is_grad_enabled():
            return
        self._pending = None
        _, idx_NK = pending
        routing_map_NE = output[1]
        used = routing_map_NE.bool()
        # Exactly the replayed experts: each replayed one is set, and no other.
        hit_N = used.gather(1, idx_NK).all(-1) & (used.sum(-1) == idx_NK.shape[-1])
        self.counts[0] += hit_N.numel()
        self.counts[1] += hit_N.sum()

    def take(self, group: Any = None) -> tuple[int, int, int]:
        """``(rows, matched, natural_differs)`` summed over ``group``; resets the counters.

        NOTE: device-to-host sync (one ``tolist``), only when the loop logs.
        """
        counts = self.counts.clone()
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(counts, group=group)
        self.counts.zero_()
        rows, matched, differs = counts.tolist()
        return rows, matched, differs


def _same_sets(a_NK: torch.Tensor, b_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per row: do ``a`` and ``b`` name the same set of experts (order-free)?"""
    a = torch.zeros(a_NK.shape[0], num_experts, dtype=torch.bool, device=a_NK.device)
    b = torch.zeros_like(a)
    a.scatter_(1, a_NK, True)
    b.scatter_(1, b_NK.to(a_NK.device), True)
    return (a == b).all(-1)
