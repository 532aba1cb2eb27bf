"""Megatron's chunk sort with the pads in it, as one gather planned on the device (pure torch,
never imports megatron).

After the EP all-to-all the dispatcher holds rows in ``[source rank][local expert]`` chunks and
sorts them by expert. When the chunk counts are on the host (Megatron copies them for its own
chunk sort) :mod:`megatron_ext.moe.aligned_chunk_sort` splices the pads into that ``cat``. Under
Transformer Engine's fused permute the counts stay on the device; reading them would be a
device-to-host sync, so this module plans the sorted, padded layout on the device instead, with
sync-free ops (``cumsum``, ``searchsorted``, gathers), and moves the data once: one gather through
the inverse index and a zero fill of only the pad rows, never a zero-filled buffer plus a scatter.

Worked example (align 4, one source chunk, 2 experts with 3 and 1 tokens)::

    received rows    [a b c | d]               tokens_per_expert_E = [3, 1]
    aligned buffer   [a b c _ | d _ _ _]       aligned counts      = [4, 4]
    dest_idx_N       [0 1 2 4]                 (row i of the input lands at dest_idx_N[i])
    gather_idx_P     [0 1 2 0 | 3 0 0 0]       (pads gather row 0, then are zeroed)

The one host integer needed, the buffer length, comes from counts the dispatcher already holds
on the host (exact, no new sync) or from the static bound ``static_aligned_rows`` (the last
expert's group absorbs the slack so all groups stay aligned).

Shape legend: N rows received (unaligned), P rows of the aligned buffer, E local experts,
R source chunks the rows arrive in (TP x EP ranks; 1 when already expert-major), C = R*E chunks,
D hidden size, Q = P - N pad rows.
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
    """Where each received row sits in the aligned expert-major buffer, and back.

    Attributes:
        dest_idx_N: Buffer row of each received row (device, int64).
        gather_idx_P: Received row each buffer row copies (device, int64); pad rows point at
            row 0 (any real row) and are zeroed after the gather.
        pad_idx_Q: The ``Q = P - N`` pad rows of the buffer, ascending (device, int64).
        tokens_per_expert_E: Aligned group sizes (device, int64), each a multiple of the
            alignment, summing to ``num_rows``.
        num_rows: Buffer length P (host int).
        align: The alignment multiple used.
    """

    dest_idx_N: torch.Tensor
    gather_idx_P: torch.Tensor
    pad_idx_Q: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    num_rows: int
    align: int


def plan_aligned_layout(
    counts_RE: torch.Tensor, align: int, num_received: int, num_rows: int
) -> AlignedLayout:
    """Plans the aligned expert-major layout of rows arriving in ``[source chunk][expert]`` order.

    Rows arrive as chunks ``(r=0,e=0), (r=0,e=1), ..., (r=1,e=0), ...`` of sizes ``counts_RE``
    (Megatron's all-to-all order; pass ``counts.view(1, E)`` for rows already sorted by expert).
    Chunk ``(r, e)`` goes to ``aligned_start[e] + sum_{r' < r} counts_RE[r', e]``, so the copy
    that pads also sorts by expert.

    Sync-free: only ``cumsum``/``searchsorted``/gathers/scatters on device tensors; the two
    lengths are host ints the caller already has.

    Args:
        counts_RE: Rows per (source chunk, local expert); device tensor, shape [R, E], summing
            to ``num_received``.
        align: Alignment multiple (> 1).
        num_received: Rows received N (the received tensor's ``shape[0]``).
        num_rows: Buffer length P, from ``aligned_rows_from_host_counts`` or
            ``static_aligned_rows``; must be at least the exact aligned total (a smaller value
            cannot be detected without a sync and would corrupt the last group).

    Returns:
        The layout. With a static bound, the last expert's group absorbs the slack rows.
    """
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
    # Offset of chunk (r, e) inside expert e's group: rows of the same expert in earlier chunks.
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
    """Copies received rows into the zero-padded aligned buffer.

    One gather through the inverse index, then only the pad rows are zeroed (no zero-fill of
    the whole buffer, no second copy). Differentiable: the gradient of ``x_N`` is the buffer
    gradient gathered at ``dest_idx_N``; pad rows receive nothing.

    Args:
        x_N: Received rows, shape [N, ...] (hidden states ``[N, D]`` or probs ``[N]``).
        layout: From ``plan_aligned_layout``.

    Returns:
        ``x_P`` of shape [P, ...] with zero pad rows.
    """
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
    """Plans the layout on the device and gathers the rows and their probs into it.

    Args: as :func:`plan_aligned_layout`; ``host_tokens_per_expert_E``: the per-expert counts
    Megatron already copied to the host (the aligned group sizes are rounded from them).

    Returns:
        ``(layout, x_P, aligned group sizes, probs_P)``.
    """
    layout = plan_aligned_layout(counts_RE, align, x_N.shape[0], num_rows)
    aligned_E = give_slack_to_last(round_up(host_tokens_per_expert_E.long(), align), num_rows)
    return layout, pad_to_layout(x_N, layout), aligned_E, pad_to_layout(probs_N, layout)


def strip_layout(y_P: torch.Tensor, layout: AlignedLayout) -> torch.Tensor:
    """Drops pad rows and restores the received row order (undoing the sort by expert too).

    Differentiable: the gradient of ``y_P`` is zero on pad rows.

    Args:
        y_P: Rows of the aligned buffer, shape [P, ...].
        layout: The layout ``pad_to_layout`` used.

    Returns:
        ``y_N`` of shape [N, ...] in the order the rows were received.
    """
    assert y_P.shape[0] == layout.num_rows, "y_P rows differ from the planned layout"
    return _StripRows.apply(y_P, layout.dest_idx_N, layout.gather_idx_P, layout.pad_idx_Q)
