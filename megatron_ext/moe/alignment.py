"""Sync-free grouped-GEMM alignment of dispatched MoE tokens (pure torch, never imports megatron).

Low-precision grouped GEMMs need every expert's group of rows to start and end on a multiple of
the quantization block: 16 rows for fp8, 32 for mxfp8 (the 1x32 scale blocks run along M in the
weight-gradient GEMM ``dW = dO^T @ X``), 128 for nvfp4. bf16/fp16 need nothing, and padding them
only costs time, so their alignment is 0 and every function here is then the identity (no copy).

After the token dispatcher has received its rows, this module lays them out expert-major with each
expert's group starting at an aligned offset and zero rows filling the gaps, and strips the pads
again on the way back. The rows may arrive in source-chunk order (Megatron's all-to-all delivers
``[source rank][local expert]`` chunks), so the same copy also does the sort by local expert.

Worked example (align 4, one source chunk, 2 experts with 3 and 1 tokens)::

    received rows    [a b c | d]               tokens_per_expert_E = [3, 1]
    aligned buffer   [a b c _ | d _ _ _]       aligned counts      = [4, 4]
    dest_idx_N       [0 1 2 4]                 (row i of the input lands at dest_idx_N[i])

Everything is computed on the device from device counts with sync-free ops (``cumsum``,
``searchsorted``, gathers). The data moves once: one gather through the inverse index
``gather_idx_P`` (``[0 1 2 0 | 3 0 0 0]`` above) and a zero fill of only the pad rows, never a
zero-filled buffer plus a scatter. The one host integer needed, the buffer length, comes either
from counts the dispatcher already holds on the host (exact, no new sync) or from a static bound
(``static_aligned_rows``; the last expert's group absorbs the slack so all groups stay aligned).

Shape legend: N rows received (unaligned), P rows of the aligned buffer, E local experts,
R source chunks the rows arrive in (TP x EP ranks; 1 when already expert-major), C = R*E chunks,
D hidden size, Q = P - N pad rows.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

#: Alignment multiple per precision. 0 means no alignment (identity, no copy).
ALIGN_BY_PRECISION: dict[str, int] = {
    "fp32": 0,
    "bf16": 0,
    "fp16": 0,
    "fp8": 16,
    "mxfp8": 32,
    "nvfp4": 128,
}


def align_size_for(precision: str, override: int | None = None) -> int:
    """Returns the row multiple each expert group must be padded to.

    Args:
        precision: One of ``ALIGN_BY_PRECISION`` (``"bf16"``, ``"fp8"``, ``"mxfp8"``, ...).
        override: A user-chosen multiple that wins over a quantized precision's default; 0 or 1
            disables. Ignored for bf16/fp16/fp32, which stay untouched (no padding, no copy).

    Returns:
        The alignment multiple; 0 means no alignment.

    Raises:
        ValueError: Unknown precision or a negative override.
    """
    if precision not in ALIGN_BY_PRECISION:
        raise ValueError(
            f"unknown precision {precision!r} for MoE alignment; "
            f"expected one of {sorted(ALIGN_BY_PRECISION)}"
        )
    if override is not None:
        if override < 0:
            raise ValueError(f"--moe-dispatch-align-size must be >= 0, got {override}")
        if ALIGN_BY_PRECISION[precision] == 0:
            return 0  # unquantized GEMMs need no alignment: padding would only cost time
        return 0 if override <= 1 else override
    return ALIGN_BY_PRECISION[precision]


def precision_of(
    fp8: str | None, fp8_recipe: object = None, fp4: str | None = None, fp4_recipe: object = None
) -> str:
    """Names the GEMM precision of a run from Megatron's fp8/fp4 settings.

    Args:
        fp8: Megatron's ``fp8`` (a format such as ``"e4m3"``/``"hybrid"``, or None when off).
        fp8_recipe: ``fp8_recipe`` (``"delayed"``, ``"tensorwise"``, ``"blockwise"``, ``"mxfp8"``,
            or Megatron's ``Fp8Recipe`` enum).
        fp4: Megatron's ``fp4`` format, or None when off.
        fp4_recipe: ``fp4_recipe``; every fp4 recipe aligns to 128 in Megatron 0.19.

    Returns:
        ``"nvfp4"``, ``"mxfp8"``, ``"fp8"`` or ``"bf16"`` (no quantized GEMM).
    """

    def name(recipe: object) -> str:
        return str(getattr(recipe, "value", recipe))

    del fp4_recipe  # every fp4 recipe of Megatron 0.19 aligns like nvfp4 (128)
    if fp4:
        return "nvfp4"
    if fp8:
        return "mxfp8" if name(fp8_recipe) == "mxfp8" else "fp8"
    return "bf16"


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


def host_to_device(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A small host tensor on ``like``'s device without a stream sync (itself on the CPU).

    Pinned and copied asynchronously: a blocking or pageable host-to-device copy would wait
    for the stream. The caching host allocator keeps the pinned block until the copy has run.
    """
    if like.is_cpu:
        return host
    return host.pin_memory().to(like.device, non_blocking=True)


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


def host_pad_rows(counts: Sequence[int], aligned: Sequence[int]) -> np.ndarray:
    """The buffer rows of every pad, ascending, from host counts and their aligned group sizes.

    Host work only (numpy, a few microseconds): group ``e`` holds its ``counts[e]`` real rows
    and then ``aligned[e] - counts[e]`` pads (the last group may also hold a static bound's
    slack). :func:`pad_rows_of_groups` is the device version, for counts that stay on the device.

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


def gather_and_zero_pads(
    src_M: torch.Tensor, gather_idx_P: torch.Tensor, pad_idx_Q: torch.Tensor
) -> torch.Tensor:
    """``src_M[gather_idx_P]`` with the pad rows zeroed: one gather, then only Q rows written.

    No autograd of its own: the callers' ``autograd.Function``s use it in forward or backward.
    With no source rows (M = 0) every row is a pad: a zero buffer.
    """
    if src_M.shape[0] == 0:
        return src_M.new_zeros((gather_idx_P.shape[0], *src_M.shape[1:]))
    out_P = src_M.index_select(0, gather_idx_P)
    return out_P.index_fill_(0, pad_idx_Q, 0)


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
