"""Megatron's chunk sort with the pads in it, as one gather planned on the device (pure torch,
never imports megatron).

Under Transformer Engine's fused permute the all-to-all's chunk counts stay on the device (reading
them would sync), so the sorted, padded layout is planned there with sync-free ops and the data
moves once. Align 4, one source chunk, 2 experts with 3 and 1 tokens::

    received rows    [a b c | d]       ->  aligned buffer [a b c _ | d _ _ _]
    gather_idx_P     [0 1 2 0 | 3 0 0 0]   (pads gather row 0, then are zeroed)

Shape legend: N rows received, P rows of the aligned buffer, E local experts, R source chunks
(TP x EP ranks; 1 when already expert-major), C = R*E chunks, D hidden size, Q = P - N pad rows.
"""

from dataclasses import dataclass

import torch

from megatron_ext.moe.alignment import (
    gather_and_zero_pads,
    give_slack_to_last,
    is_identity,
    pad_rows_of_groups,
    round_up,
)


@dataclass(frozen=True)
class AlignedLayout:
    """Where each received row sits in the aligned expert-major buffer, and back."""

    #: Buffer row of each received row (device int64, as the other tensors).
    dest_idx_N: torch.Tensor
    #: Received row each buffer row copies; pad rows point at row 0 and are zeroed after.
    gather_idx_P: torch.Tensor
    #: The ``Q = P - N`` pad rows of the buffer, ascending.
    pad_idx_Q: torch.Tensor
    #: Aligned group sizes, summing to ``num_rows``.
    tokens_per_expert_E: torch.Tensor
    num_rows: int  # P (host int)
    align: int


def plan_aligned_layout(
    counts_RE: torch.Tensor, align: int, num_received: int, num_rows: int
) -> AlignedLayout:
    """Plans, sync-free, the aligned expert-major layout of ``num_received`` rows arriving in
    chunks of ``counts_RE`` (device ``[R, E]``, Megatron's all-to-all order; ``view(1, E)`` for
    rows already sorted by expert), into ``num_rows`` rows (exact or a static bound)."""
    # num_rows is never less than the exact total: undetectable without a sync, it would corrupt
    # the last group (which absorbs a static bound's slack).
    assert counts_RE.dim() == 2, "counts_RE must be [R, E]"
    assert not is_identity(align), "identity alignment needs no layout"
    assert num_rows >= num_received, "the buffer holds every received row"
    counts_RE = counts_RE.long()
    counts_C = counts_RE.reshape(-1)
    src_end_C = counts_C.cumsum(0)
    src_start_C = src_end_C - counts_C

    real_E = counts_RE.sum(0)
    aligned_E = give_slack_to_last(round_up(real_E, align), num_rows)
    aligned_start_E = aligned_E.cumsum(0) - aligned_E
    # Chunk (r, e) goes to aligned_start[e] + sum_{r' < r} counts_RE[r', e]: the copy that pads
    # also sorts by expert.
    within_RE = counts_RE.cumsum(0) - counts_RE
    dest_start_C = (aligned_start_E.unsqueeze(0) + within_RE).reshape(-1)

    row_N = torch.arange(num_received, device=counts_RE.device)
    # Chunk of each row: the first chunk whose end lies beyond it (empty chunks are skipped).
    chunk_N = torch.searchsorted(src_end_C, row_N, right=True)
    dest_idx_N = dest_start_C.gather(0, chunk_N) + (row_N - src_start_C.gather(0, chunk_N))
    # The inverse index: pad rows keep 0 (a real row when N > 0) and are zeroed after the gather.
    gather_idx_P = torch.zeros(num_rows, dtype=torch.long, device=counts_RE.device)
    gather_idx_P.scatter_(0, dest_idx_N, row_N)
    pad_idx_Q = pad_rows_of_groups(
        aligned_start_E + real_E, aligned_E - real_E, num_rows - num_received
    )
    return AlignedLayout(
        dest_idx_N=dest_idx_N,
        gather_idx_P=gather_idx_P,
        pad_idx_Q=pad_idx_Q,
        tokens_per_expert_E=aligned_E,
        num_rows=num_rows,
        align=align,
    )


class _PadRows(torch.autograd.Function):
    """Received rows -> aligned buffer; the backward is the strip's gather (pads get nothing)."""

    @staticmethod
    def forward(ctx, x_N, dest_idx_N, gather_idx_P, pad_idx_Q):
        ctx.save_for_backward(dest_idx_N)
        return gather_and_zero_pads(x_N, gather_idx_P, pad_idx_Q)

    @staticmethod
    def backward(ctx, grad_P):
        (dest_idx_N,) = ctx.saved_tensors
        return grad_P.index_select(0, dest_idx_N), None, None, None


class _StripRows(torch.autograd.Function):
    """Aligned buffer -> received rows; the backward is the pad's gather (pad rows get 0)."""

    @staticmethod
    def forward(ctx, y_P, dest_idx_N, gather_idx_P, pad_idx_Q):
        ctx.save_for_backward(gather_idx_P, pad_idx_Q)
        return y_P.index_select(0, dest_idx_N)

    @staticmethod
    def backward(ctx, grad_N):
        gather_idx_P, pad_idx_Q = ctx.saved_tensors
        return gather_and_zero_pads(grad_N, gather_idx_P, pad_idx_Q), None, None, None


def pad_to_layout(x_N: torch.Tensor, layout: AlignedLayout) -> torch.Tensor:
    """``x_P`` ``[P, ...]``: received rows ``x_N`` (hidden states or probs) in the zero-padded
    aligned buffer; the gradient is the buffer's gathered at ``dest_idx_N``."""
    # One gather through the inverse index, then only the pad rows zeroed: no zero-fill of the
    # whole buffer, no second copy.
    assert x_N.shape[0] == layout.dest_idx_N.shape[0], "x_N rows differ from the planned layout"
    return _PadRows.apply(x_N, layout.dest_idx_N, layout.gather_idx_P, layout.pad_idx_Q)


def pad_received_rows(
    x_N: torch.Tensor,
    probs_N: torch.Tensor,
    counts_RE: torch.Tensor,
    align: int,
    num_rows: int,
    host_tokens_per_expert_E: torch.Tensor,
) -> tuple[AlignedLayout, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(layout, x_P, aligned group sizes, probs_P)``: the layout planned on the device, the
    rows and probs gathered into it; the sizes rounded from ``host_tokens_per_expert_E``."""
    layout = plan_aligned_layout(counts_RE, align, x_N.shape[0], num_rows)
    aligned_E = give_slack_to_last(round_up(host_tokens_per_expert_E.long(), align), num_rows)
    return layout, pad_to_layout(x_N, layout), aligned_E, pad_to_layout(probs_N, layout)


def strip_layout(y_P: torch.Tensor, layout: AlignedLayout) -> torch.Tensor:
    """``y_N``: the buffer's rows without pads, in the order they were received (the gradient of
    ``y_P`` is zero on pad rows)."""
    assert y_P.shape[0] == layout.num_rows, "y_P rows differ from the planned layout"
    return _StripRows.apply(y_P, layout.dest_idx_N, layout.gather_idx_P, layout.pad_idx_Q)
