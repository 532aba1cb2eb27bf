"""Grouped-GEMM alignment of dispatched MoE tokens: multiples, sizes, shared pieces (pure torch,
never imports megatron).

Low-precision grouped GEMMs need every expert's group of rows to start and end on a multiple of
the quantization block: 16 rows for fp8, 32 for mxfp8 (the 1x32 scale blocks run along M in the
weight-gradient GEMM ``dW = dO^T @ X``), 128 for nvfp4. bf16/fp16 need nothing, and padding them
only costs time, so their alignment is 0 and every function here is then the identity (no copy).
The multiple itself is Megatron's rule, decided once per layer outside this module
(:func:`megatron_ext.moe.config.align_size_for_config`); here it is a plain int.

This module holds what every aligned layout shares: rounding counts
up (on the device and on the host), the buffer length (exact from host counts, or the static
bound ``static_aligned_rows`` when no count has reached the host), the pad rows of a layout, the
shared zero rows pads are copied from, and the gather that zeroes pads. The layouts themselves:
:mod:`~megatron_ext.moe.aligned_permute` (pads folded into Megatron's permute),
:mod:`~megatron_ext.moe.aligned_chunk_sort` (pads spliced into its chunk sort, host counts) and
:mod:`~megatron_ext.moe.aligned_chunk_gather` (the chunk sort planned on the device).

Worked example (align 4, 2 experts with 3 and 1 tokens)::

    tokens_per_expert_E  [3, 1]  ->  round_up  [4, 4]      buffer [a b c _ | d _ _ _]
    static_aligned_rows(4 rows, 2 experts, 4) = 8         (any split of 4 rows fits in 8)

Shape legend: N rows (unaligned), P rows of the aligned buffer, E experts, D hidden size,
Q = P - N pad rows.
"""

import itertools
from collections.abc import Sequence

import numpy as np
import torch


def is_identity(align: int) -> bool:
    """True when ``align`` asks for no padding at all (bf16/fp16, 0 or 1)."""
    return align <= 1


def round_up(n: torch.Tensor, align: int) -> torch.Tensor:
    """Rounds each count up to a multiple of ``align`` (identity when ``align <= 1``)."""
    if is_identity(align):
        return n
    if align & (align - 1) == 0:  # a power of two (every recipe's multiple): two kernels
        return (n + (align - 1)).bitwise_and_(-align)
    return (n + (align - 1)) // align * align


def give_slack_to_last(aligned_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """In place: the last group takes the rows a static bound ``num_rows`` adds to the aligned
    total. Both are multiples of the alignment, so every group stays aligned. Returns it."""
    aligned_E[-1:] += num_rows - aligned_E.sum()
    return aligned_E


#: Zero rows by (dtype, device, row shape): the pads' source, shared by every caller, only read.
#: Each entry is ``(buffer, its first row)``: the one-row view costs no slicing op per call.
_ZERO_ROWS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _zero_entry(like: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    row_shape = like.shape[1:]
    key = (like.dtype, like.device, row_shape)
    entry = _ZERO_ROWS.get(key)
    if entry is None or entry[0].shape[0] < rows:
        grown = max(rows, 2 * (0 if entry is None else entry[0].shape[0]), 1)
        zeros = like.new_zeros((grown, *row_shape))
        entry = _ZERO_ROWS[key] = (zeros, zeros[:1])
    return entry


def shared_zero_rows(like: torch.Tensor, rows: int) -> torch.Tensor:
    """At least ``rows`` zero rows shaped, typed and placed like ``like``'s rows (never write).

    One buffer per kind for the whole process, grown by doubling; callers slice what they need.
    """
    return _zero_entry(like, rows)[0]


def shared_zero_row(like: torch.Tensor) -> torch.Tensor:
    """One zero row ``[1, ...]`` like ``like``'s rows: a view of :func:`shared_zero_rows`'s
    buffer, made when the buffer is (so the permute's trash row costs no slicing op)."""
    return _zero_entry(like, 1)[1]


def aligned_rows_from_host_counts(
    tokens_per_expert_E: torch.Tensor | Sequence[int], align: int
) -> int:
    """Exact aligned buffer length from counts the caller already holds on the host.

    Args:
        tokens_per_expert_E: Per-expert counts as a CPU tensor or a Python sequence. Passing a
            device tensor is a bug: reading it would be a new device-to-host sync.
        align: Alignment multiple.

    Returns:
        ``sum(round_up(tokens_per_expert_E, align))``.
    """
    return real_and_aligned_rows_from_host_counts(tokens_per_expert_E, align)[1]


def real_and_aligned_rows_from_host_counts(
    tokens_per_expert_E: torch.Tensor | Sequence[int], align: int
) -> tuple[int, int]:
    """``(sum(counts), sum(round_up(counts, align)))`` from host counts, in one read.

    Args: as :func:`aligned_rows_from_host_counts`.
    """
    if isinstance(tokens_per_expert_E, torch.Tensor):
        assert tokens_per_expert_E.device.type == "cpu", "host counts must already be on the host"
        counts = tokens_per_expert_E.tolist()
    else:
        counts = list(tokens_per_expert_E)
    real = int(sum(counts))
    if is_identity(align):
        return real, real
    return real, sum(round_up_host(counts, align))


def round_up_host(counts: Sequence[int], align: int) -> list[int]:
    """Each host count rounded up to a multiple of ``align`` (> 1): the aligned group sizes.

    Python ints, for counts already on the host; :func:`round_up` is the device version.
    """
    return [-(-int(c) // align) * align for c in counts]


def host_group_sizes(
    counts: list[int], align: int, static: bool
) -> tuple[int, int, torch.Tensor, torch.Tensor, tuple[list[int], list[int]]]:
    """A permute's group sizes from per-expert counts already on the host (Python ints).

    Args:
        counts: Routed rows per local expert.
        align: Alignment multiple (> 1).
        static: Size by the static bound (the last group takes the slack) instead of exactly.

    Returns:
        ``(real rows N, buffer rows P, aligned sizes [E], group starts [E], (counts, aligned
        sizes))``; the two tensors are host int64 tensors.
    """
    aligned = round_up_host(counts, align)
    num_real, num_rows = sum(counts), sum(aligned)
    if static:
        # The slack rows join the last group, as in the device layout.
        static_rows = static_aligned_rows(num_real, len(counts), align)
        aligned[-1] += static_rows - num_rows
        num_rows = static_rows
    # One host array, cut by numpy: torch's own indexing would add two dispatched ops.
    sizes = np.array([*aligned, *itertools.accumulate(aligned[:-1], initial=0)], np.int64)
    num_experts = len(aligned)
    aligned_E = torch.from_numpy(sizes[:num_experts])
    start_E = torch.from_numpy(sizes[num_experts:])
    return num_real, num_rows, aligned_E, start_E, (counts, aligned)


def host_pad_rows(counts: Sequence[int], aligned: Sequence[int]) -> np.ndarray:
    """The buffer rows of every pad, ascending, from host counts and their aligned group sizes.

    Host work only (numpy, a few microseconds): group ``e`` holds its ``counts[e]`` real rows
    and then ``aligned[e] - counts[e]`` pads (the last group may also hold a static bound's
    slack). :func:`pad_rows_of_groups` is the device
    version, for counts that stay on the device.

    Returns:
        int64 array ``[Q]``, ``Q = sum(aligned) - sum(counts)``.
    """
    counts_E = np.asarray(counts, dtype=np.int64)
    aligned_E = np.asarray(aligned, dtype=np.int64)
    pads_E = aligned_E - counts_E
    pad_end_E = pads_E.cumsum()
    # Row q (counting pads only) of group e lies at first_pad[e] + (q - pads before group e).
    first_pad_E = aligned_E.cumsum() - aligned_E + counts_E
    shift_Q = np.repeat(first_pad_E - (pad_end_E - pads_E), pads_E)
    return shift_Q + np.arange(shift_Q.shape[0], dtype=np.int64)


def pad_rows_of_groups(
    first_pad_E: torch.Tensor, pads_E: torch.Tensor, num_pads: int
) -> torch.Tensor:
    """Lists the pad rows of an aligned buffer, sync-free, from per-group pad ranges.

    Args:
        first_pad_E: First pad row of each group (its start plus its real rows), device int64.
        pads_E: Pad rows of each group (device int64), summing to ``num_pads``.
        num_pads: Q, a host int (buffer length minus real rows).

    Returns:
        ``pad_idx_Q``: ascending buffer rows of every pad, shape [Q].
    """
    pad_end_E = pads_E.cumsum(0)
    q_Q = torch.arange(num_pads, device=pads_E.device)
    group_Q = torch.searchsorted(pad_end_E, q_Q, right=True)
    return (first_pad_E - (pad_end_E - pads_E)).gather(0, group_Q) + q_Q


def static_aligned_rows(num_rows: int, num_experts: int, align: int) -> int:
    """Smallest static buffer length that fits any split of ``num_rows`` rows over the experts.

    ``sum_e A*ceil(c_e/A) <= A*floor((N + E*(A-1))/A)``, because each ceil adds at most A-1.

    Args:
        num_rows: Rows received (N), known on the host from the received tensor's shape.
        num_experts: Local experts (E).
        align: Alignment multiple (A).

    Returns:
        The bound P; a multiple of ``align``.
    """
    if is_identity(align):
        return num_rows
    return (num_rows + num_experts * (align - 1)) // align * align


def gather_and_zero_pads(
    src_M: torch.Tensor, gather_idx_P: torch.Tensor, pad_idx_Q: torch.Tensor
) -> torch.Tensor:
    """``src_M[gather_idx_P]`` with the pad rows zeroed: one gather, then only Q rows written.

    The pad rows are written twice (the gather copies a real row there first): torch's gather
    that writes each row once, ``embedding_bag`` with empty bags, turns -0.0 into +0.0
    (tests/moe/test_aligned_permute_writes.py pins it), and these rows must be Megatron's bits.

    No autograd of its own: the callers' ``autograd.Function``s use it in forward or backward.
    With no source rows (M = 0) every row is a pad: a zero buffer.
    """
    if src_M.shape[0] == 0:
        return src_M.new_zeros((gather_idx_P.shape[0], *src_M.shape[1:]))
    out_P = src_M.index_select(0, gather_idx_P)
    return out_P.index_fill_(0, pad_idx_Q, 0)


def leading_rows(buffer_P: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The first ``num_rows`` rows of a buffer (a view), whose gradient writes each row once.

    A static-bound buffer cut to its exact length once host counts arrive: autograd's own slice
    backward fills a zero buffer of the whole length and copies the gradient into its prefix
    (the kept rows written twice); here the kept rows are copied and only the cut rows zeroed.
    """
    if num_rows == buffer_P.shape[0] or not (buffer_P.requires_grad and torch.is_grad_enabled()):
        return buffer_P[:num_rows]
    return _LeadingRows.apply(buffer_P, num_rows)


class _LeadingRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer_P, num_rows):
        ctx.num_rows_all = buffer_P.shape[0]
        return buffer_P[:num_rows]

    @staticmethod
    def backward(ctx, grad_N):
        grad_P = grad_N.new_empty((ctx.num_rows_all, *grad_N.shape[1:]))
        grad_P[: grad_N.shape[0]].copy_(grad_N)
        grad_P[grad_N.shape[0] :].zero_()
        return grad_P, None
