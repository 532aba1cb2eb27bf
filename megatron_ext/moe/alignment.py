"""Grouped-GEMM alignment of dispatched MoE tokens: multiples, sizes, shared pieces (pure torch,
never imports megatron).

Low-precision grouped GEMMs need every expert's group of rows to be a multiple of the quantization
block (fp8 16, mxfp8 32, nvfp4 128); bf16/fp16 need nothing (alignment 0: every function here is
then the identity). Align 4, 2 experts with 3 and 1 tokens::

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
    """In place (and returned): the last group takes the rows a static bound ``num_rows`` adds
    to the aligned total."""
    # Both are multiples of the alignment: every group stays aligned.
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
    """At least ``rows`` zero rows shaped, typed and placed like ``like``'s rows (never write)."""
    # One buffer per kind for the whole process, grown by doubling; callers slice what they need.
    return _zero_entry(like, rows)[0]


def shared_zero_row(like: torch.Tensor) -> torch.Tensor:
    """One zero row ``[1, ...]`` like ``like``'s rows: a view of :func:`shared_zero_rows`'s
    buffer, made when the buffer is (so the permute's trash row costs no slicing op)."""
    return _zero_entry(like, 1)[1]


def aligned_rows_from_host_counts(
    tokens_per_expert_E: torch.Tensor | Sequence[int], align: int
) -> int:
    """``sum(round_up(tokens_per_expert_E, align))`` from counts already on the host (a CPU
    tensor or a Python sequence: a device tensor would be a new device-to-host sync)."""
    return real_and_aligned_rows_from_host_counts(tokens_per_expert_E, align)[1]


def real_and_aligned_rows_from_host_counts(
    tokens_per_expert_E: torch.Tensor | Sequence[int], align: int
) -> tuple[int, int]:
    """``(sum(counts), sum(round_up(counts, align)))`` from host counts, in one read."""
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
    """Each host count (Python ints) rounded up to a multiple of ``align`` (> 1)."""
    return [-(-int(c) // align) * align for c in counts]


def host_group_sizes(
    counts: list[int], align: int, static: bool
) -> tuple[int, int, torch.Tensor, torch.Tensor, tuple[list[int], list[int]]]:
    """``(real rows N, buffer rows P, aligned sizes [E], group starts [E], (counts, aligned
    sizes))`` of per-expert host counts, exact or (``static``) by the static bound; the two
    tensors are host int64."""
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
    """int64 ``[Q]``: the buffer rows of every pad, ascending, from host counts and their
    aligned group sizes (numpy, a few microseconds; :func:`pad_rows_of_groups` is the device
    version)."""
    # Group e holds its counts[e] real rows, then aligned[e] - counts[e] pads (the last group
    # may also hold a static bound's slack).
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
    """``pad_idx_Q``: the ascending buffer rows of every pad, sync-free, from each group's first
    pad row and pad count (device int64; ``num_pads`` Q their host-known sum)."""
    pad_end_E = pads_E.cumsum(0)
    q_Q = torch.arange(num_pads, device=pads_E.device)
    group_Q = torch.searchsorted(pad_end_E, q_Q, right=True)
    return (first_pad_E - (pad_end_E - pads_E)).gather(0, group_Q) + q_Q


def static_aligned_rows(num_rows: int, num_experts: int, align: int) -> int:
    """Smallest static buffer length P (a multiple of ``align``) that fits any split of
    ``num_rows`` rows (N, known on the host from the received shape) over the experts."""
    # sum_e A*ceil(c_e/A) <= A*floor((N + E*(A-1))/A): each ceil adds at most A-1.
    if is_identity(align):
        return num_rows
    return (num_rows + num_experts * (align - 1)) // align * align


def gather_and_zero_pads(
    src_M: torch.Tensor, gather_idx_P: torch.Tensor, pad_idx_Q: torch.Tensor
) -> torch.Tensor:
    """``src_M[gather_idx_P]`` with the pad rows zeroed: one gather, then only Q rows written (no
    autograd of its own: the callers' ``autograd.Function``s use it)."""
    # The pad rows are written twice (the gather copies a real row there first): the gather that
    # writes each row once, embedding_bag with empty bags, turns -0.0 into +0.0
    # (tests/moe/test_aligned_permute_writes.py pins it), and these rows must be Megatron's bits.
    if src_M.shape[0] == 0:  # no source rows: every row is a pad
        return src_M.new_zeros((gather_idx_P.shape[0], *src_M.shape[1:]))
    out_P = src_M.index_select(0, gather_idx_P)
    return out_P.index_fill_(0, pad_idx_Q, 0)


def leading_rows(buffer_P: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The first ``num_rows`` rows of a buffer (a view), whose gradient writes each row once."""
    # A static-bound buffer cut once host counts arrive: autograd's slice backward fills a zero
    # buffer of the whole length and copies into its prefix (kept rows written twice); here the
    # kept rows are copied and only the cut rows zeroed.
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
