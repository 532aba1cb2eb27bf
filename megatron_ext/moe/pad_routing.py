"""Pads cost nothing in the MoE layer: skip-dispatch of pad tokens and pads-first capacity dropping
(pure torch, never imports megatron; docs/pad_routing.md).

In ``skip`` mode the MoE layer clears the pads' rows of the routing map after routing (and replay),
so pads send no row through the all-to-all and reach no expert GEMM; real tokens are untouched.
4 tokens, 3 experts, top-1, tokens 2 and 3 pads::

    routing_map = [[1 0 0]    pad_T = [F F T T]    cleared = [[1 0 0]
                   [0 1 0]                                    [0 1 0]
                   [0 1 0]                                    [0 0 0]
                   [0 0 1]]                                   [0 0 0]]
    Megatron sizes its permute output N * topk = 4 rows on the host; (N - pads) * topk = 2 rows
    exist, which the host knows before the batch reaches the device (:class:`PadRouting`).

Legend: T tokens the router sees, E experts.
"""

import warnings
from collections.abc import Hashable
from typing import Literal

import torch

from megatron_ext.common.micro_batch import MicroBatchContext

PadRoutingMode = Literal["dispatch", "skip", "auto"]
PAD_ROUTING_MODES: tuple[str, ...] = ("dispatch", "skip", "auto")


def resolve_pad_routing(
    mode: str,
    *,
    capacity_factor: float | None,
    pad_to_capacity: bool,
    cuda_graph_over_moe: bool,
    dispatcher: str,
    router_padding: bool,
    gloo_expert_tp: bool = False,
) -> tuple[Literal["dispatch", "skip"], str]:
    """``(resolved mode, reason)`` of ``--moe-pad-routing`` ``mode`` and the flags of the same
    names (``capacity_factor`` None: dropless; ``gloo_expert_tp``: ``--cpu`` with expert TP > 1):
    ``auto`` is ``skip`` wherever nothing needs the pads' rows; ``skip`` asked for where it
    cannot run is a ValueError naming both flags."""
    if mode not in PAD_ROUTING_MODES:
        raise ValueError(f"--moe-pad-routing must be one of {PAD_ROUTING_MODES}, got {mode!r}")
    blockers = _skip_blockers(
        pad_to_capacity, cuda_graph_over_moe, dispatcher, router_padding, gloo_expert_tp
    )
    if mode == "skip" and blockers:
        raise ValueError(f"--moe-pad-routing skip cannot be combined with {blockers[0]}")
    if mode == "dispatch":
        return "dispatch", "asked for"
    if mode == "skip":
        return "skip", "asked for"
    if blockers:
        return "dispatch", f"auto: {blockers[0].split(' (')[0]} needs the pads' rows"
    if capacity_factor is not None:  # not a blocker: pads are dropped first instead
        return "dispatch", "auto: --moe-expert-capacity-factor (pads are dropped first instead)"
    return "skip", "auto: dropless dispatch, nothing needs the pads' rows"


def _skip_blockers(
    pad_to_capacity: bool,
    cuda_graph_over_moe: bool,
    dispatcher: str,
    router_padding: bool,
    gloo_expert_tp: bool,
) -> list[str]:
    """The settings under which pads' rows are needed, each with why."""
    blockers = []
    if pad_to_capacity:
        blockers.append(
            "--moe-pad-expert-input-to-capacity (static expert shapes: every slot is filled anyway)"
        )
    if cuda_graph_over_moe:
        blockers.append("--cuda-graph-impl over the MoE layer (captured static shapes)")
    if dispatcher not in ("alltoall", "allgather"):
        blockers.append(f"--moe-token-dispatcher-type {dispatcher} (only alltoall and allgather)")
    if router_padding:
        blockers.append(
            "--moe-router-padding-for-quantization (it re-adds token rows to the routing map; "
            "use --moe-dispatch-align)"
        )
    if gloo_expert_tp:
        # The dispatcher's TP all-gather then gets uneven sizes (real tokens differ per TP rank).
        blockers.append(
            "--cpu and --expert-tensor-parallel-size > 1 (gloo has no uneven all-gather; NCCL has)"
        )
    return blockers


def clear_pad_routes(
    probs_TE: torch.Tensor, routing_map_TE: torch.Tensor, pad_T: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads route nowhere: their routing-map rows cleared, their probabilities zeroed (sync-free).

    ``pad_T``: any shape with T elements in the router's token order, True = pad.
    """
    # masked_fill writes only pad rows: real tokens' rows and gradients come back bit for bit.
    pad_T1 = pad_T.reshape(-1, 1).bool()
    assert pad_T1.shape[0] == routing_map_TE.shape[0], (
        f"padding_mask has {pad_T1.shape[0]} tokens, routing map {routing_map_TE.shape[0]}"
    )
    return probs_TE.masked_fill(pad_T1, 0.0), routing_map_TE & ~pad_T1


def pads_first_keep(
    kept_real_TE: torch.Tensor,
    routing_map_TE: torch.Tensor,
    probs_TE: torch.Tensor,
    pad_T: torch.Tensor,
    capacity: int,
    drop_policy: str,
) -> torch.Tensor:
    """bool ``[T, E]``: the pads' routes (of ``routing_map_TE``, before dropping) that keep a
    slot: per expert only the ``capacity`` slots ``kept_real_TE`` left free, ranked as Megatron's
    ``drop_policy`` ranks (``"probs"``: highest first; ``"position"``: earliest first)."""
    pad_T1 = pad_T.reshape(-1, 1).bool()
    pad_map_TE = routing_map_TE & pad_T1
    free_E = capacity - kept_real_TE.sum(dim=0)
    if drop_policy == "position":
        rank_TE = pad_map_TE.long().cumsum(dim=0) - 1
    elif drop_policy == "probs":
        score_TE = probs_TE.detach().masked_fill(~pad_map_TE, float("-inf"))
        order_TE = score_TE.argsort(dim=0, descending=True, stable=True)
        rank_TE = torch.empty_like(order_TE)
        position_T1 = torch.arange(order_TE.shape[0], device=order_TE.device).unsqueeze(1)
        position_TE = position_T1.expand_as(order_TE)
        rank_TE.scatter_(0, order_TE, position_TE)
    else:
        raise ValueError(
            f"--moe-token-drop-policy must be 'probs' or 'position', got {drop_policy!r}"
        )
    return pad_map_TE & (rank_TE < free_E.unsqueeze(0))


def count_router_tokens(
    pad_mask: torch.Tensor,
    model_shape: tuple[int, int],
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    sequence_parallel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[int, int]:
    """``(router rows, real among them)`` on this rank, from a host pad mask (no device read).

    ``pad_mask``: the micro-batch's, on the host (True = pad); ``model_shape``: the model's
    ``[batch, seq]`` (THD: ``[1, B*S]``); ``cu_seqlens``: a THD row's host boundaries (CP splits it
    per document; None: the zigzag).
    """
    # The rows a rank's routers see: the micro-batch sliced for CP and, under SP, for this TP rank.
    from megatron_ext.common.token_positions import router_row_positions

    assert pad_mask.device.type == "cpu", "the pad count is taken on the host copy"
    positions_N = router_row_positions(
        *model_shape,
        cp_size=cp_size,
        cp_rank=cp_rank,
        tp_size=tp_size,
        tp_rank=tp_rank,
        sequence_parallel=sequence_parallel,
        cu_seqlens=cu_seqlens,
    )
    pads = int(pad_mask.reshape(-1).bool()[positions_N].sum())
    return positions_N.numel(), positions_N.numel() - pads


class PadRouting:
    """The pad routing of one run and the host-side real-token count of each micro-batch.

    The forward step announces the count before the batch goes to the device
    (:meth:`set_micro_batch`); the MoE layer asks for it (:meth:`real_tokens`).

    Args:
        mode: The resolved mode, ``"skip"`` or ``"dispatch"``.
        required: A micro-batch without an announced count is an error (``skip`` asked for);
            else (``auto``) its pads are routed like text, with one warning.
        micro_batches: The run's micro-batch context (None: one of its own, each
            :meth:`set_micro_batch` beginning a micro-batch).
    """

    def __init__(
        self,
        mode: Literal["dispatch", "skip"],
        *,
        required: bool = True,
        micro_batches: MicroBatchContext | None = None,
    ) -> None:
        if mode not in ("dispatch", "skip"):
            raise ValueError(
                f"PadRouting needs a resolved mode ('dispatch' or 'skip'), got {mode!r}"
            )
        self.mode = mode
        self.required = required
        self._owns_context = micro_batches is None
        self.micro_batches = MicroBatchContext() if micro_batches is None else micro_batches
        #: Per micro-batch key: (router rows, real rows) on this rank. Kept per key: activation
        #: recompute reruns the layer in backward, possibly after later micro-batches' forwards.
        self._counts: dict[Hashable, tuple[int, int]] = {}
        #: The context's serial when the current count was announced (-1: none is current).
        self._announced = -1
        #: MoE layers that took the current count in a forward: one asking again is the next
        #: micro-batch's forward, which nobody announced (its count is not this one).
        self._used_by: set[Hashable] = set()
        self._warned = False

    @property
    def skip(self) -> bool:
        """Whether pads are cleared from the routing map before dispatch."""
        return self.mode == "skip"

    def set_micro_batch(self, num_tokens: int, num_real_tokens: int) -> None:
        """The current micro-batch's router rows on this rank: how many, and how many are real (host
        ints). With a context of its own, the next forward is a new micro-batch."""
        if not 0 <= num_real_tokens <= num_tokens:
            raise ValueError(f"{num_real_tokens} real tokens of {num_tokens}: not a count")
        context = self.micro_batches
        if self._owns_context:
            context.begin(context.serial + 1)
        self._counts[context.forward_key] = (int(num_tokens), int(num_real_tokens))
        self._announced, self._used_by = context.serial, set()

    def clear(self) -> None:
        """Forgets every micro-batch (once per training step, after the last backward)."""
        self._counts.clear()
        self._announced, self._used_by = -1, set()

    def real_tokens(self, padding_mask: torch.Tensor, layer: Hashable = None) -> int | None:
        """Real tokens among the rows of ``padding_mask`` (host int; nothing read from the device).

        ``layer``: the asking layer's number (one that already took the count in a forward runs
        the next micro-batch, unannounced). Returns None (route pads like text) when nothing was
        announced and not ``required``; ValueError when required, or for another token count.
        """
        context = self.micro_batches
        if context.recomputing:  # the micro-batch in backward, whatever ran forward since
            counts = self._counts.get(context.key)
            if counts is None and self.required:
                raise ValueError(
                    f"--moe-pad-routing skip: a recomputed MoE layer runs micro-batch "
                    f"{context.key!r}, for which no forward announced a count"
                )
            return None if counts is None else counts[1]
        current = self._counts.get(context.forward_key)
        if self._announced != context.serial:
            current = None
        if current is not None and layer is not None:
            if layer in self._used_by:  # a second forward on the same announcement: stale
                current, self._announced, self._used_by = None, -1, set()
            else:
                self._used_by.add(layer)
        if current is None:
            message = (
                "--moe-pad-routing skip needs the host-side real-token count of each micro-batch: "
                "call PadRouting.set_micro_batch before every forward (megatron_ext.pretrain_gpt's "
                "forward_step does), or use --moe-pad-routing dispatch"
            )
            if self.required:
                raise ValueError(message)
            if not self._warned:
                self._warned = True
                warnings.warn(f"{message}; pads are routed like text meanwhile", stacklevel=2)
            return None
        num_tokens, num_real = current
        if padding_mask.numel() != num_tokens:
            raise ValueError(
                f"--moe-pad-routing skip: the router sees {padding_mask.numel()} tokens, the "
                f"forward step announced {num_tokens}"
            )
        return num_real
