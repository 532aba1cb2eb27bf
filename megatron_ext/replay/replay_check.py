"""Verifies route replay inside the training loop: which routes did Megatron's routers use?

With ``--route-replay-check``, each training micro-batch's first forward through a replaying router
is compared on the device with what the binding decided: recorded rows used exactly, missing rows
routed as the policy decided, and how often the router's own top-k would differ (docs/replay.md,
"Replay check"). At a log iteration, ``native`` policy::

    megatron_ext replay check: 1024 (token, layer) rows with a recorded route, 1024 used exactly;
    1024 without one, 1024 routed by the model's own router (native); the model's own router would
    have chosen differently on 991 of the recorded rows (96.8%)
"""

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import torch

#: What ``--replay-missing-route-policy`` does with a row that has no recorded route.
POLICY_DECIDES = {
    "native": "routed by the model's own router (native)",
    "balanced": "filled with a balanced top-k (balanced), routed as filled",
}


@dataclasses.dataclass(frozen=True)
class ReplayCounts:
    """One log interval's (token, layer) rows of this pipeline stage's MoE layers."""

    recorded: int
    recorded_exact: int
    missing: int
    missing_as_decided: int
    natural_differs: int
    policy: str

    def line(self) -> str:
        """The line the loop prints."""
        share = f" ({self.natural_differs / self.recorded:.1%})" if self.recorded else ""
        return (
            f"{self.recorded} (token, layer) rows with a recorded route, {self.recorded_exact} "
            f"used exactly; {self.missing} without one, {self.missing_as_decided} "
            f"{POLICY_DECIDES[self.policy]}; the model's own router would have chosen differently "
            f"on {self.natural_differs} of the recorded rows{share}"
        )

    def problems(self) -> list[str]:
        """What must not happen: rows not routed as decided, or nothing replayed at all."""
        found = []
        if self.recorded_exact != self.recorded:
            found.append(
                f"ERROR: {self.recorded - self.recorded_exact} of {self.recorded} (token, layer) "
                "rows with a recorded route were NOT routed as recorded"
            )
        if self.missing_as_decided != self.missing:
            found.append(
                f"ERROR: {self.missing - self.missing_as_decided} of {self.missing} rows without "
                f"a recorded route were not routed as --replay-missing-route-policy {self.policy} "
                "decided"
            )
        if self.recorded == 0 and self.missing:
            found.append(
                "WARNING: no row of this interval had a recorded route: nothing was replayed "
                f"(every row was {POLICY_DECIDES[self.policy].split(' (')[0]})"
            )
        return found

    def record(self) -> dict[str, int | str]:
        """The counts as a JSON object (``--moe-expert-load-log``)."""
        return dataclasses.asdict(self)


class ReplayCheck:
    """Device counters of the (token, layer) rows replayed by one rank's routers.

    ``policy`` is named in the report; ``pads_skipped`` (``--moe-pad-routing skip``): pads'
    rows reach no expert and are not counted.
    """

    #: Order of the counters in :attr:`counts`.
    FIELDS = ("recorded", "recorded_exact", "missing", "missing_as_decided", "natural_differs")

    def __init__(self, policy: str = "native", *, pads_skipped: bool = False) -> None:
        if policy not in POLICY_DECIDES:
            raise ValueError(f"--replay-missing-route-policy: unknown policy {policy!r}")
        self.policy = policy
        self.pads_skipped = pads_skipped
        #: The counters, in :attr:`FIELDS` order (None until a routing is counted).
        self.counts: torch.Tensor | None = None
        self._counted_key: Hashable | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None
        self._hooks: list[Any] = []
        self._device = torch.device("cpu")  # the routers' (attach)

    def attach(self, binding: Any) -> None:
        """Hooks every router ``binding`` replays into (forward hooks: no change to routing)."""
        from megatron.core.transformer.moe.router import TopKRouter

        for router, _ in binding._restore:  # (router, previous RouterReplay) pairs
            assert isinstance(router, TopKRouter)
            self._device = router.weight.device
            self._hooks.append(router.register_forward_hook(self._compare, with_kwargs=True))
        binding.on_replay = self._observe

    def count(self, key: Hashable | None) -> None:
        """The micro-batch whose forward runs next is counted if it is ``key`` (a training
        micro-batch); ``None``: the next forwards are not counted (evaluation)."""
        self._counted_key = key

    def _observe(
        self,
        key: Hashable,
        scores_NE: torch.Tensor,
        idx_NK: torch.Tensor,
        missing_N: torch.Tensor | None,
        natural: Callable[[], torch.Tensor],
    ) -> None:
        """Called by the binding in every forward (not recompute) routing of a replaying layer,
        with the indices it returns and the rows without a recorded route (None: none)."""
        # Every forward, with or without grad (activation recompute runs it without), never a
        # recompute in backward nor an evaluation forward: each micro-batch's rows count once.
        if key is None or key != self._counted_key:
            return
        # The router's own top-k of the same scores, one more top-k for this diagnostic only.
        differs_N = ~_same_sets(natural(), idx_NK, scores_NE.shape[-1])
        self._pending = (idx_NK, missing_N, differs_N)

    def _compare(self, router: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        # The router's routing map (output[1]) is what Megatron dispatches by: compare with it.
        del router
        pending = self._pending
        if pending is None:  # not counted (evaluation, a recompute in backward)
            return
        self._pending = None
        idx_NK, missing_N, differs_N = pending
        used_NE = output[1].bool()
        # Exactly the decided experts: each one is set, and no other.
        hit_N = used_NE.gather(1, idx_NK).all(-1) & (used_NE.sum(-1) == idx_NK.shape[-1])
        if missing_N is None:
            missing_N = torch.zeros_like(hit_N)
        recorded_N = ~missing_N
        pad_N = self._skipped_pads(args, kwargs)
        if pad_N is not None:  # rows that reached no expert: neither recorded nor missing
            assert pad_N.shape == hit_N.shape, (pad_N.shape, hit_N.shape)
            recorded_N, missing_N = recorded_N & ~pad_N, missing_N & ~pad_N
        # Device tensors only: read when the loop logs (take).
        row = torch.stack(
            [
                recorded_N.sum(),
                (hit_N & recorded_N).sum(),
                missing_N.sum(),
                (hit_N & missing_N).sum(),
                (differs_N & recorded_N).sum(),
            ]
        )
        if self.counts is None:  # on the routers' device from the first routing on
            self.counts = row
        else:
            self.counts += row

    def _skipped_pads(self, args: Any, kwargs: Any) -> torch.Tensor | None:
        """The router's ``padding_mask`` as rows (True = pad) when pads are skipped, else None."""
        if not self.pads_skipped:
            return None
        # Megatron's MoELayer.route calls router(hidden_states, padding_mask).
        pad = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
        return None if pad is None else pad.reshape(-1).bool()

    def take(self, group: Any = None) -> ReplayCounts:
        """The counts summed over ``group``; resets the counters.

        NOTE: device-to-host sync (one ``tolist``), only when the loop logs.
        """
        counts = self.counts
        if counts is None:  # nothing counted on this rank (every rank of a group joins below)
            counts = torch.zeros(len(self.FIELDS), dtype=torch.long, device=self._device)
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(counts, group=group)
        self.counts = None
        return ReplayCounts(
            **dict(zip(self.FIELDS, counts.tolist(), strict=True)), policy=self.policy
        )


def _same_sets(a_NK: torch.Tensor, b_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per row: do ``a`` and ``b`` name the same set of experts (order-free)?"""
    a = torch.zeros(a_NK.shape[0], num_experts, dtype=torch.bool, device=a_NK.device)
    b = torch.zeros_like(a)
    a.scatter_(1, a_NK, True)
    b.scatter_(1, b_NK, True)
    return (a == b).all(-1)
