"""The alignment state a token dispatcher carries from dispatch to combine (Megatron glue).

Both aligned dispatchers (:mod:`megatron_ext.moe.token_dispatcher`) own one
:class:`GroupAligner`. Its group multiple is decided once per layer, from Megatron's rules for the
config's precision (:func:`align_size_for_config`); it picks the layout for what the dispatcher holds, pads
on the way to the experts and strips on the way back:

- a routing map (EP=1, or the all-gather dispatcher): :mod:`~megatron_ext.moe.aligned_permute`,
  the pad folded into Megatron's permute;
- received chunks with host counts (all-to-all, EP > 1):
  :mod:`~megatron_ext.moe.aligned_chunk_sort`, the pad spliced into Megatron's chunk sort;
- received chunks with device counts (TE's fused permute):
  :mod:`~megatron_ext.moe.aligned_chunk_gather`, one gather planned on the device.

The buffer is sized exactly from host counts Megatron already holds (``host_counts``) or by a
static bound (``static_bound``): no sizing adds a device-to-host sync.

Example (fp8, 2 experts with 3 and 1 rows): ``pad`` returns 32 rows ``[a b c _*13 | d _*15]`` and
sizes ``[16, 16]``; ``strip`` of the experts' output returns the 4 real rows in their order.
"""

import torch

from megatron_ext.moe import aligned_chunk_gather as cg
from megatron_ext.moe import aligned_chunk_sort as cs
from megatron_ext.moe import aligned_permute as ap
from megatron_ext.moe import alignment as al


class GroupAligner:
    """The alignment state one dispatcher carries between dispatch and combine.

    The multiple is given once, by the MoE layer that owns the dispatcher
    (:func:`align_size_for_config` of its config at construction; ``AlignedMoELayer.realign``
    passes a new one down when a caller changes the precision). ``pad`` and ``strip`` are the only
    entry points that touch rows (tools/gpu/gpu_check.py guards exactly these two). The zero rows
    the chunk sort splices in are slices of :func:`~megatron_ext.moe.alignment.shared_zero_rows`.

    Args:
        align: The group multiple (0 or 1: no alignment; the dispatchers defer to Megatron's).
        buffer_sizing: ``--moe-dispatch-align-buffer`` (``host_counts`` or ``static_bound``).
    """

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
        """Builds the aligned buffer with one copy of the rows.

        Three layouts, told apart by ``routing``:

        - a bool routing map ``[T, E]``: ``x`` are the tokens ``[T, D]`` and ``probs`` their
          ``[T, E]`` probabilities; Megatron's permute and the pad in one gather.
        - host counts ``[R][E]`` (Python ints): ``x``/``probs`` are rows received in ``[source
          chunk][expert]`` order; Megatron's chunk sort (one ``cat``) with the pads spliced in.
        - device counts ``[R, E]``: the same rows; one gather through an inverse index sorts
          and pads (when the counts never reached the host: Megatron's fused-permute path).

        Args:
            x: Rows to lay out (see above).
            probs: Their routing probabilities.
            routing: The local routing map, or the received chunks' counts.
            host_tokens_per_expert_E: The per-expert counts Megatron already copied to the host
                (permute only), or None where they have not arrived yet (all-to-all at EP=1:
                a static-bound buffer, cut to the exact length by ``exact_host_sizes``).
            num_out_tokens: Rows the permute emits (Megatron's ``num_out_tokens``); permute
                without host counts only.
            rank_TE: The routing map's ``rank_within_expert`` when the caller took its counts
                from it (permute only).

        Returns:
            ``(x_P, aligned tokens_per_expert_E, probs_P)``; the counts are a host tensor, or
            None for a permute without host counts (its caller gets them from
            ``exact_host_sizes`` once Megatron's host counts arrive).
        """
        align = self.align
        if isinstance(routing, list):  # host chunk counts
            static_rows = self._static_rows(x.shape[0], routing, align)
            self.layout, x_P, aligned_E, probs_P = cs.pad_received_chunks(
                x, probs, routing, align, static_rows
            )
        elif routing.dtype != torch.bool:  # device chunk counts
            num_rows = self._static_rows(x.shape[0], routing, align)
            if num_rows is None:
                num_rows = _host_rows(host_tokens_per_expert_E, align)[1]
            self.layout, x_P, aligned_E, probs_P = cg.pad_received_rows(
                x, probs, routing, align, num_rows, host_tokens_per_expert_E
            )
        else:  # a routing map: the permute, sized now from host counts or by the static bound
            counts = None
            if host_tokens_per_expert_E is not None:
                counts = read_host_counts(host_tokens_per_expert_E)
            self.layout, x_P, aligned_E, probs_P = ap.pad_by_permute(
                x,
                probs,
                routing,
                align,
                num_out_tokens,
                counts=counts,
                static=self.buffer_sizing != "host_counts",
                rank_TE=rank_TE,
            )
        return x_P, aligned_E, probs_P

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
        """Sizes a static-bound permute once Megatron's host counts have arrived.

        ``host_counts`` sizing cuts the buffer to the exact aligned length (a prefix: views, no
        copy); ``static_bound`` keeps it. Returns ``(x_P, host aligned counts, probs_P)``.
        """
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

    NOTE: reads a CPU tensor that Megatron's dispatcher already copied to the host and
    synchronised (``_maybe_dtoh_and_synchronize``, or the all-gather dispatcher's ``.cpu()``); on
    a GPU this is no device-to-host sync. The CPU sync detector still counts it as a value read.
    """
    assert host_counts.is_cpu, "host counts must already be on the host"
    return host_counts.tolist()


def _host_rows(host_tokens_per_expert_E: torch.Tensor, align: int) -> tuple[int, int]:
    """``(rows, exact aligned rows)`` from host-resident counts, in one read (see above)."""
    return al.real_and_aligned_rows_from_host_counts(host_tokens_per_expert_E, align)
