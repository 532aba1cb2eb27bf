"""Megatron's chunk sort with the grouped-GEMM pads spliced in (pure torch, never imports megatron).

After the EP all-to-all Megatron sorts the received ``[source rank][local expert]`` chunks by expert
with one split + ``cat`` from host counts; here the same ``cat`` also pads, with slices of a shared
zero buffer (never written), which the un-sort drops. One copy of the rows, as Megatron's, and a
plan of host ints only.

Shape legend: N rows received, P rows of the aligned buffer, E local experts, R source chunks
(TP x EP ranks), C = R*E chunks.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_ext.moe.alignment import is_identity, shared_zero_rows


@dataclass(frozen=True)
class ChunkLayout:
    """Megatron's chunk sort with the pads in it, planned from host counts (Python ints).

    The aligned buffer is a concatenation of pieces: for each expert, its chunk from every source
    in source order, then its pad rows (a slice of a shared zero buffer). Worked example
    (align 4, ``counts_RE = [[1, 2], [2, 0]]``: received ``a | b c | d e | -``)::

        buffer pieces  [a] [d e] [_]  [b c] [] [_ _]     ->   [a d e _ | b c _ _]
        buffer_sizes   [1, 2, 1, 2, 0, 2]      source_C [0, 2, -1, 1, 3, -1]   (-1: pad)

    """

    #: Chunk sizes in arrival order ``(r, e)``, r-major.
    received_sizes_C: list[int]
    #: Piece sizes in buffer order, and each piece's received chunk (-1: a pad piece).
    buffer_sizes: list[int]
    source_C: list[int]
    #: Aligned group sizes (the last takes any static-bound slack).
    tokens_per_expert_E: list[int]
    num_rows: int  # P

    @property
    def max_pad(self) -> int:
        """Rows of the largest pad piece (the zero buffer must hold at least this many)."""
        pads = [n for n, c in zip(self.buffer_sizes, self.source_C, strict=True) if c < 0]
        return max(pads, default=0)


def plan_chunk_layout(
    counts_RE: Sequence[Sequence[int]], align: int, num_rows: int | None = None
) -> ChunkLayout:
    """Plans the padded chunk sort from per-chunk counts ``[R][E]`` already on the host (no
    kernel); ``num_rows``: a static bound P, None for the exact aligned total."""
    assert not is_identity(align), "identity alignment needs no layout"
    num_experts = len(counts_RE[0])
    received = [int(n) for counts_E in counts_RE for n in counts_E]
    real_E = [sum(int(counts_E[e]) for counts_E in counts_RE) for e in range(num_experts)]
    aligned_E = [-(-n // align) * align for n in real_E]
    if num_rows is None:
        num_rows = sum(aligned_E)
    assert num_rows >= sum(aligned_E) and num_rows % align == 0, (num_rows, aligned_E)
    aligned_E[-1] += num_rows - sum(aligned_E)
    sizes, source = [], []
    for e in range(num_experts):
        for r in range(len(counts_RE)):
            sizes.append(received[r * num_experts + e])
            source.append(r * num_experts + e)
        sizes.append(aligned_E[e] - real_E[e])
        source.append(-1)
    return ChunkLayout(received, sizes, source, aligned_E, num_rows)


def pad_chunks(x_N: torch.Tensor, layout: ChunkLayout, zeros: torch.Tensor) -> torch.Tensor:
    """Sorts received chunks by expert and pads each group: one ``cat`` (Megatron's own copy);
    pad rows are slices of ``zeros`` (at least ``layout.max_pad`` rows like ``x_N``'s)."""
    chunks = x_N.split(layout.received_sizes_C)
    pieces = [
        chunks[c] if c >= 0 else zeros[:n]
        for n, c in zip(layout.buffer_sizes, layout.source_C, strict=True)
        if n
    ]
    return torch.cat(pieces) if pieces else x_N[:0]


def pad_received_chunks(
    x_N: torch.Tensor,
    probs_N: torch.Tensor,
    counts_RE: Sequence[Sequence[int]],
    align: int,
    num_rows: int | None = None,
) -> tuple[ChunkLayout, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(layout, x_P, aligned group sizes (a host tensor), probs_P)``: the padded chunk sort
    planned and the received rows and probs sorted into it."""
    # The pads are slices of the process's shared zero rows: reused across calls, never written.
    layout = plan_chunk_layout(counts_RE, align, num_rows)
    x_P = pad_chunks(x_N, layout, shared_zero_rows(x_N, layout.max_pad))
    probs_P = pad_chunks(probs_N, layout, shared_zero_rows(probs_N, layout.max_pad))
    return layout, x_P, torch.tensor(layout.tokens_per_expert_E), probs_P


def strip_chunks(y_P: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """Drops the pad pieces and restores the arrival order: one ``cat``."""
    pieces = y_P.split(layout.buffer_sizes)
    position = {c: i for i, c in enumerate(layout.source_C) if c >= 0}
    kept = [pieces[position[c]] for c in range(len(layout.received_sizes_C))]
    return torch.cat(kept)
