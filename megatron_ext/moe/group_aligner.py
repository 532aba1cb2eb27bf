"""The alignment state a token dispatcher carries from dispatch to combine (Megatron glue).

Each aligned dispatcher owns one :class:`GroupAligner`: it picks the layout for what the dispatcher
holds (a routing map: :mod:`~megatron_ext.moe.aligned_permute`; received chunks with host counts:
:mod:`~megatron_ext.moe.aligned_chunk_sort`; with device counts, TE's fused permute:
:mod:`~megatron_ext.moe.aligned_chunk_gather`), pads on the way to the experts and strips on the
way back. fp8, 2 experts with 3 and 1 rows: ``pad`` returns 32 rows ``[a b c _*13 | d _*15]`` and
sizes ``[16, 16]``; ``strip`` of the experts' output returns the 4 real rows in their order.
"""

import torch

from megatron_ext.moe import aligned_chunk_gather as cg
from megatron_ext.moe import aligned_chunk_sort as cs
from megatron_ext.moe import aligned_permute as ap
from megatron_ext.moe import alignment as al


class GroupAligner:
    """The alignment state one dispatcher carries between dispatch and combine.

    Args:
        align: The group multiple, given once by the MoE layer that owns the dispatcher
            (``AlignedMoELayer.realign`` passes a new one); 0 or 1: the dispatchers defer to
            Megatron's.
        buffer_sizing: ``--moe-dispatch-align-buffer``: exact from host counts Megatron already
            holds (``host_counts``) or a static bound (``static_bound``); neither adds a sync.
    """

    # pad and strip are the only entry points that touch rows (tools/gpu/gpu_check.py guards
    # exactly these two).

    def __init__(self, align: int, buffer_sizing: str) -> None:
        self.align = align
        self.buffer_sizing = buffer_sizing
        self.layout: cg.AlignedLayout | cs.ChunkLayout | ap.PermuteLayout | None = None

    @property
    def active(self) -> bool:
        return not al.is_identity(self.align)

    @property
    def fused(self) -> bool:
        """True while a permute-folded layout is pending (its strip is the unpermute)."""
        return isinstance(self.layout, ap.PermuteLayout)

    def pad(
        self,
        x: torch.Tensor,
        probs: torch.Tensor,
        routing: torch.Tensor | list[list[int]],
        host_tokens_per_expert_E: torch.Tensor | None,
        num_out_tokens: int | None = None,
        rank_TE: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Builds the aligned buffer with one copy of the rows, in the layout ``routing`` asks.

        Args:
            x, probs: The tokens and their ``[T, E]`` probabilities (a routing map), or rows
                received in ``[source chunk][expert]`` order and their probabilities.
            routing: The local bool routing map ``[T, E]``, or the received chunks' counts:
                host ``[R][E]`` Python ints, or device ``[R, E]`` (TE's fused permute).
            host_tokens_per_expert_E: The per-expert counts Megatron already copied to the host;
                None before they arrive (EP=1 all-to-all: cut by :meth:`exact_host_sizes`).

        Returns ``(x_P, aligned host counts or None, probs_P)``.
        """
        if isinstance(routing, list):
            self.layout, x_P, aligned_E, probs_P = self._pad_host_chunks(x, probs, routing)
        elif routing.dtype != torch.bool:
            self.layout, x_P, aligned_E, probs_P = self._pad_device_chunks(
                x, probs, routing, host_tokens_per_expert_E
            )
        else:
            self.layout, x_P, aligned_E, probs_P = self._pad_permute(
                x, probs, routing, host_tokens_per_expert_E, num_out_tokens, rank_TE
            )
        return x_P, aligned_E, probs_P

    def _pad_host_chunks(self, x: torch.Tensor, probs: torch.Tensor, counts: list) -> tuple:
        """Host chunk counts: Megatron's chunk sort (one ``cat``) with the pads spliced in."""
        static_rows = self._static_rows(x.shape[0], counts, self.align)
        return cs.pad_received_chunks(x, probs, counts, self.align, static_rows)

    def _pad_device_chunks(
        self,
        x: torch.Tensor,
        probs: torch.Tensor,
        counts_RE: torch.Tensor,
        host_tokens_per_expert_E: torch.Tensor | None,
    ) -> tuple:
        """Device chunk counts (they never reached the host: Megatron's fused-permute path): one
        gather through an inverse index sorts and pads."""
        num_rows = self._static_rows(x.shape[0], counts_RE, self.align)
        if num_rows is None:
            num_rows = _host_rows(host_tokens_per_expert_E, self.align)[1]
        return cg.pad_received_rows(
            x, probs, counts_RE, self.align, num_rows, host_tokens_per_expert_E
        )

    def _pad_permute(
        self,
        x: torch.Tensor,
        probs: torch.Tensor,
        routing_map_TE: torch.Tensor,
        host_tokens_per_expert_E: torch.Tensor | None,
        num_out_tokens: int | None,
        rank_TE: torch.Tensor | None,
    ) -> tuple:
        """A routing map: Megatron's permute and the pad in one gather, sized now from host
        counts or by the static bound."""
        counts = None
        if host_tokens_per_expert_E is not None:
            counts = read_host_counts(host_tokens_per_expert_E)
        return ap.pad_by_permute(
            x,
            probs,
            routing_map_TE,
            self.align,
            num_out_tokens,
            counts=counts,
            static=self.buffer_sizing != "host_counts",
            rank_TE=rank_TE,
        )

    def _static_rows(
        self, num_received: int, counts: torch.Tensor | list, align: int
    ) -> int | None:
        """The static bound for ``static_bound`` sizing; None for exact (host counts) sizing."""
        if self.buffer_sizing == "host_counts":
            return None
        return al.static_aligned_rows(num_received, len(counts[0]), align)

    def exact_host_sizes(
        self, x_P: torch.Tensor, probs_P: torch.Tensor, host_tokens_per_expert_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sizes a static-bound permute once Megatron's host counts have arrived: ``host_counts``
        cuts it to the exact aligned length (a prefix: views, no copy), ``static_bound`` keeps it.
        Returns ``(x_P, host aligned counts, probs_P)``."""
        assert self.fused, "exact_host_sizes follows a permute-folded pad"
        if self.buffer_sizing != "host_counts":
            aligned_E = al.round_up(host_tokens_per_expert_E.long(), self.align)
            return x_P, al.give_slack_to_last(aligned_E, self.layout.num_rows), probs_P
        num_real, num_rows, aligned_E, _, host_sizes = al.host_group_sizes(
            read_host_counts(host_tokens_per_expert_E), self.align, static=False
        )
        # Host ints, free: the rows laid out are the rows Megatron counted (a caller that routes
        # a token nowhere must lower num_out_tokens to match, as Megatron's permute requires).
        assert num_real == self.layout.num_rows - self.layout.num_pads, num_real
        self.layout = self.layout.narrow(num_rows, host_sizes)
        return al.leading_rows(x_P, num_rows), aligned_E, al.leading_rows(probs_P, num_rows)

    def strip(self, y_P: torch.Tensor) -> torch.Tensor:
        """Drops pad rows: back in received order, or (permute-folded) unpermuted to tokens."""
        layout, self.layout = self.layout, None
        assert layout is not None, "combine without a matching dispatch"
        if isinstance(layout, ap.PermuteLayout):
            return ap.unpermute_from_layout(y_P, layout)
        if isinstance(layout, cs.ChunkLayout):
            return cs.strip_chunks(y_P, layout)
        return cg.strip_layout(y_P, layout)


def read_host_counts(host_counts: torch.Tensor) -> list:
    """The values of counts Megatron already holds on the host, in one read.

    NOTE: reads a CPU tensor Megatron's dispatcher already copied and synchronised
    (``_maybe_dtoh_and_synchronize``, the all-gather's ``.cpu()``): no device-to-host sync on a
    GPU, though the CPU sync detector counts it as a value read.
    """
    assert host_counts.is_cpu, "host counts must already be on the host"
    return host_counts.tolist()


def _host_rows(host_tokens_per_expert_E: torch.Tensor, align: int) -> tuple[int, int]:
    """``(rows, exact aligned rows)`` from host-resident counts, in one read (see above)."""
    return al.real_and_aligned_rows_from_host_counts(host_tokens_per_expert_E, align)
