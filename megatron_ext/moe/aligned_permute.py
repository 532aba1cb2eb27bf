"""Megatron's token permute with the grouped-GEMM alignment folded in (pure torch, no megatron).

The padding is in the *index*, not a second copy: each routed pair's buffer row is its rank within
its expert plus the expert's aligned start, so one gather builds the aligned buffer and one
scatter-add strips and unpermutes (as Transformer Engine's ``pad_offsets`` and torchtitan's permute
indices). Real rows keep Megatron's order: fp32 results are bitwise. Align 4, 3 tokens, 2 experts::

    routing_map_TE   [[1 1] [0 1] [1 0]]       counts [2 2] -> aligned [4 4], starts [0 4]
    Megatron permute [t0 t2 | t0 t1]           (expert-major, tokens ascending)
    aligned buffer   [t0 t2 _ _ | t0 t1 _ _]   token_idx_P = [0 2 T T 0 1 T T], T = 3 (trash)

Shape legend: T tokens, E local experts, D hidden, P aligned buffer rows, Q = P - N pad rows,
N routed pairs (Megatron's ``num_out_tokens``).
"""

from dataclasses import dataclass

import torch

from megatron_ext.common.device_copy import host_to_device
from megatron_ext.moe.alignment import (
    gather_and_zero_pads,
    give_slack_to_last,
    host_group_sizes,
    host_pad_rows,
    round_up,
    shared_zero_row,
    static_aligned_rows,
)


# Not frozen: a frozen dataclass sets each field through object.__setattr__, which costs more than
# the rest of the layout's bookkeeping on the few-token path, where host work is the whole cost.
@dataclass(slots=True, eq=False)
class PermuteLayout:
    """The aligned permute of one routing map (never changed once planned: :meth:`narrow` makes
    a new one)."""

    #: Flat ``t * E + e`` pair of each buffer row (the probs' element); ``T * E`` on pad rows.
    pair_idx_P: torch.Tensor
    #: Token of each buffer row; ``T`` (a trash row) on pad rows.
    token_idx_P: torch.Tensor
    #: Each expert's real count rounded up (device int64); None once narrowed or when planned
    #: from host group starts.
    aligned_E: torch.Tensor | None
    num_rows: int  # P, T and Q = P - N: host ints
    num_tokens: int
    num_pads: int
    #: P is the exact aligned total (no static-bound slack).
    exact: bool = False
    #: ``(counts, aligned sizes)`` per group as Python ints, when the caller holds them on the
    #: host (the last size takes any slack).
    host_sizes: tuple[list[int], list[int]] | None = None

    @property
    def tokens_per_expert_E(self) -> torch.Tensor | None:
        """Aligned group sizes summing to ``num_rows`` (device): the last group takes a static
        bound's slack. None once narrowed (the host counts are the group sizes by then)."""
        # On demand (three small kernels under a static bound): callers holding host counts never
        # need it.
        if self.aligned_E is None or self.exact:
            return self.aligned_E
        return give_slack_to_last(self.aligned_E.clone(), self.num_rows)

    @property
    def pad_idx_Q(self) -> torch.Tensor:
        """The pad rows (on demand: only the gather that zeroes pads after copying needs them)."""
        # Listed on the host when the caller holds the sizes (one pinned asynchronous copy on a
        # GPU), else the Q largest pair indices, which hold T * E (a topk on the device).
        if self.host_sizes is not None:
            return host_to_device(
                torch.from_numpy(host_pad_rows(*self.host_sizes)), self.pair_idx_P
            )
        return self.pair_idx_P.topk(self.num_pads, sorted=False).indices

    def narrow(
        self, num_rows: int, host_sizes: tuple[list[int], list[int]] | None = None
    ) -> "PermuteLayout":
        """The first ``num_rows`` rows: a static-bound plan cut to the exact aligned length
        (``host_sizes``: the host counts that sized it)."""
        # Groups start at the same offsets under both sizings and the slack sits at the end of
        # the last group: the exact layout is a prefix of the static one (views, no copy).
        assert num_rows <= self.num_rows, "narrow only cuts"
        return PermuteLayout(  # not dataclasses.replace: it re-reads the fields on every call
            pair_idx_P=self.pair_idx_P[:num_rows],
            token_idx_P=self.token_idx_P[:num_rows],
            aligned_E=None,
            num_rows=num_rows,
            num_tokens=self.num_tokens,
            num_pads=self.num_pads - (self.num_rows - num_rows),
            exact=self.exact,
            host_sizes=host_sizes,
        )


def rank_within_expert(routing_map_TE: torch.Tensor) -> torch.Tensor:
    """1-based rank of each routed pair within its expert, ``[T, E]`` int64: the plan's first step.
    Its last row is Megatron's ``routing_map.sum(dim=0)`` (the all-gather dispatcher's counts)."""
    return routing_map_TE.cumsum(0)


def counts_from_ranks(rank_TE: torch.Tensor) -> torch.Tensor:
    """Each expert's routed count ``[E]`` from :func:`rank_within_expert` (a view of its last
    row; zeros when there are no tokens)."""
    return rank_TE[-1] if rank_TE.shape[0] else rank_TE.new_zeros(rank_TE.shape[1])


def plan_aligned_permute(
    routing_map_TE: torch.Tensor,
    align: int,
    num_out_tokens: int,
    num_rows: int,
    *,
    exact: bool = False,
    start_E: torch.Tensor | None = None,
    rank_TE: torch.Tensor | None = None,
    host_sizes: tuple[list[int], list[int]] | None = None,
) -> PermuteLayout:
    """Plans Megatron's dropless permute into an aligned, zero-padded expert-major buffer.

    Args:
        routing_map_TE: Bool ``[T, E]`` map with exactly ``num_out_tokens`` (N) True entries
            (Megatron's contract: a caller that clears rows lowers N to match).
        num_rows: P, exact (from host counts) or ``static_aligned_rows(N, E, align)``.
        start_E: Each group's first buffer row (device int64) from host counts; None: from the map.
        rank_TE: ``rank_within_expert(routing_map_TE)`` if the caller has it (read, not written).
    """
    # Sync-free and short (ten small kernels; six given start_E, five given rank_TE too: at a
    # few tokens their launch cost is the whole cost). The cumsum replaces Megatron's
    # masked_select; nothing reads a device value.
    assert routing_map_TE.dtype == torch.bool and align > 1 and num_rows >= num_out_tokens
    num_tokens, num_experts = routing_map_TE.shape  # (a map that is not 2-D fails here)
    num_pairs = num_tokens * num_experts
    if rank_TE is None:
        rank_TE = rank_within_expert(routing_map_TE)
    aligned_E = None
    if start_E is None:
        aligned_E = round_up(counts_from_ranks(rank_TE), align)
        start_E = aligned_E.cumsum(0).sub_(aligned_E)
    # Buffer row + 1 of each routed pair (its rank is 1-based); 0 is a trash slot for the rest.
    slot_TE = rank_TE.add(start_E).mul_(routing_map_TE)
    pair_idx = slot_TE.new_full((num_rows + 1,), num_pairs)  # int64, on the map's device
    # The scatter reads its source only where the index is, so the buffer needs no slicing.
    pair_idx.scatter_(0, slot_TE.view(-1), _arange_buffer(num_pairs, slot_TE))
    pair_idx_P = pair_idx[1:]
    return PermuteLayout(
        pair_idx_P=pair_idx_P,
        token_idx_P=pair_idx_P.div(num_experts, rounding_mode="floor"),
        aligned_E=aligned_E,
        num_rows=num_rows,
        num_tokens=num_tokens,
        num_pads=num_rows - num_out_tokens,
        exact=exact,
        host_sizes=host_sizes,
    )


def pad_by_permute(
    x_TD: torch.Tensor,
    probs_TE: torch.Tensor,
    routing_map_TE: torch.Tensor,
    align: int,
    num_out_tokens: int | None,
    *,
    counts: list[int] | None = None,
    static: bool = False,
    rank_TE: torch.Tensor | None = None,
) -> tuple[PermuteLayout, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Plans the aligned permute and builds the buffer of the tokens and of their probs.

    ``counts``: per-expert host counts (P exact unless ``static``); None: the static bound of
    ``num_out_tokens``, cut later. Returns ``(layout, x_P, aligned host counts or None, probs_P)``.
    """
    if counts is None:
        num_rows = static_aligned_rows(num_out_tokens, routing_map_TE.shape[1], align)
        layout = plan_aligned_permute(
            routing_map_TE, align, num_out_tokens, num_rows, rank_TE=rank_TE
        )
        aligned_E = None
    else:  # the groups' starts are known on the host: the plan skips computing them
        num_real, num_rows, aligned_E, start_E, host_sizes = host_group_sizes(counts, align, static)
        layout = plan_aligned_permute(
            routing_map_TE,
            align,
            num_real,
            num_rows,
            exact=not static,
            start_E=host_to_device(start_E, routing_map_TE),
            rank_TE=rank_TE,
            host_sizes=host_sizes,
        )
    return layout, permute_to_layout(x_TD, layout), aligned_E, permute_probs(probs_TE, layout)


#: One int64 ``arange`` per device, as long as the largest plan asked for.
_ARANGES: dict[torch.device, torch.Tensor] = {}


def _arange_buffer(n: int, like: torch.Tensor) -> torch.Tensor:
    """An int64 ``arange`` at least ``n`` long on ``like``'s device: the plan's scatter source."""
    # One buffer per device, rebuilt only for a larger n: one T * E index of the largest plan,
    # not one per size (variable-length batches would keep a tensor per token count). Passed
    # whole (the scatter reads it only where its index is) and never written.
    device = like.device
    values = _ARANGES.get(device)
    if values is None or values.numel() < n:
        values = _ARANGES[device] = torch.arange(n, device=device)
    return values


class _GatherWithTrash(torch.autograd.Function):
    """``src[idx]`` with pads zeroed; the backward adds rows back, pads onto a dropped trash row."""

    @staticmethod
    def forward(ctx, src_M, idx_P, pad_idx_Q):
        num_src = src_M.shape[0]
        if ctx is not None:  # None: called without autograd (see permute_to_layout)
            ctx.save_for_backward(idx_P)
            ctx.num_src = num_src
        # Pad rows index the trash row M; any real row serves for the gather before zeroing.
        return gather_and_zero_pads(src_M, idx_P.clamp(max=max(num_src - 1, 0)), pad_idx_Q)

    @staticmethod
    def backward(ctx, grad_P):
        (idx_P,) = ctx.saved_tensors
        # Megatron's gather backward is this same index_add_ into zeros, rows in the same order.
        grad = grad_P.new_zeros((ctx.num_src + 1, *grad_P.shape[1:]))
        return grad.index_add_(0, idx_P, grad_P)[: ctx.num_src], None, None


#: Below this many bytes of tokens, pads gather an appended zero row (a copy of the tokens, one
#: ``cat``); above it, the gather is followed by zeroing the Q pad rows (``index_fill_``). On CPU
#: the ``cat`` stays faster up to about 1-2 MB at hidden 1024, forward and backward, because
#: ``index_fill_`` costs about 1 ns per element there. The bound is kept lower for GPUs, where
#: zeroing Q rows is one small kernel and the ``cat`` an extra T x D copy; a device measurement
#: should set it (none was possible here).
SMALL_TOKENS_BYTES = 256 * 1024


def permute_to_layout(x_TD: torch.Tensor, layout: PermuteLayout) -> torch.Tensor:
    """Megatron's permute of the token rows, straight into the aligned buffer ``[P, D]``; the
    gradient adds rows back in buffer order (Megatron's gather backward), pads onto a trash row."""
    assert x_TD.shape[0] == layout.num_tokens, "x_TD rows differ from the routing map"
    if layout.num_pads == 0:
        # Every group already a multiple (a host int says so): Megatron's own gather, no zero
        # row to append (the cat below would copy every token once more for nothing).
        return x_TD.index_select(0, layout.token_idx_P)
    if x_TD.nbytes <= SMALL_TOKENS_BYTES:
        # Pads gather the appended zero row (index T); autograd's backward is the same
        # index_add_ into T + 1 rows, the trash row dropped by the cat's backward.
        zero = shared_zero_row(x_TD)
        return torch.cat([x_TD, zero]).index_select(0, layout.token_idx_P)
    if not (x_TD.requires_grad and torch.is_grad_enabled()):  # no graph: skip the Function
        return _GatherWithTrash.forward(None, x_TD, layout.token_idx_P, layout.pad_idx_Q)
    return _GatherWithTrash.apply(x_TD, layout.token_idx_P, layout.pad_idx_Q)


def permute_probs(probs_TE: torch.Tensor, layout: PermuteLayout) -> torch.Tensor:
    """The routed pairs' probabilities in buffer order ``[P]``, 0 on pad rows."""
    # Probs are small (T * E values): one appended zero is the pads' source. A gather, not a
    # scatter into place: its backward keeps the [P] pair indices, where a scatter's would keep
    # the [T, E] slots (8 bytes per token and local expert per layer, more than Megatron's map).
    assert probs_TE.shape[0] == layout.num_tokens, "probs rows differ from the routing map"
    flat = probs_TE.reshape(-1)
    return torch.cat([flat, shared_zero_row(flat)]).index_select(0, layout.pair_idx_P)


def unpermute_from_layout(y_PD: torch.Tensor, layout: PermuteLayout) -> torch.Tensor:
    """Strips the pads and unpermutes in one scatter-add: ``[P, D]`` -> ``[T, D]`` (Megatron's
    unpermute without probs, in its order; pad rows add onto a dropped trash row)."""
    assert y_PD.shape[0] == layout.num_rows, "y_PD rows differ from the planned layout"
    if not (y_PD.requires_grad and torch.is_grad_enabled()):  # no graph: skip the Function
        return _ScatterAddWithTrash.forward(None, y_PD, layout)
    return _ScatterAddWithTrash.apply(y_PD, layout)


class _ScatterAddWithTrash(torch.autograd.Function):
    """Rows added onto their tokens, pads onto a dropped trash row; the backward gathers."""

    # Its own backward, not autograd's of index_add_ then [:T]: the slice's backward fills a
    # [T + 1, D] zero buffer for one trash row. Here the gradient is gathered straight from
    # [T, D] and only the Q pad rows are zeroed (the same values).

    @staticmethod
    def forward(ctx, y_PD, layout):
        if ctx is not None:  # None: called without autograd (see unpermute_from_layout)
            ctx.layout = layout
        # The scatter-add's zeros are its identity (Megatron's unpermute starts from zeros too).
        out = y_PD.new_zeros((layout.num_tokens + 1, *y_PD.shape[1:]))
        # A GPU keeps Megatron's kernel (index_add_ if deterministic, else scatter_add_) until
        # measured there. On CPU index_add_: the same sums in the same order as scatter_add_
        # (bitwise in fp32, bf16, fp16; tested against Megatron's unpermute), one index per row
        # not per element, and a backward gathering rows, where most of the CPU time goes.
        if y_PD.is_cpu or torch.are_deterministic_algorithms_enabled():
            out.index_add_(0, layout.token_idx_P, y_PD)
        else:
            index = layout.token_idx_P.view(-1, *([1] * (y_PD.dim() - 1))).expand_as(y_PD)
            out.scatter_add_(0, index, y_PD)
        return out[: layout.num_tokens]

    @staticmethod
    def backward(ctx, grad_TD):
        layout = ctx.layout
        if layout.num_pads == 0:
            return grad_TD.index_select(0, layout.token_idx_P), None
        # Pad rows index the trash row T; any real row serves for the gather before zeroing.
        idx_P = layout.token_idx_P.clamp(max=max(layout.num_tokens - 1, 0))
        return gather_and_zero_pads(grad_TD, idx_P, layout.pad_idx_Q), None
