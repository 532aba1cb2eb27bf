"""Pack planning: which document pieces go into which pack (pure numpy; never imports megatron).

Whole documents are packed into packs of at most ``capacity`` tokens. Over-long documents are
first ``split`` into capacity-sized pieces, ``truncate``d to their head, or ``drop``ped, and
counted. Two algorithms:

- ``sequential``: keep the (shuffled) order and close a pack when the next piece does not fit
  (next-fit). One ``searchsorted`` per pack, no per-token work.
- ``best_fit``: within each window of ``window`` consecutive pieces, place pieces longest first
  into the open pack with the least room that still fits (best-fit-decreasing). Fewer pads;
  the window bounds how far a document can move from its shuffled position.

Worked example (capacity 8, lengths ``[5, 6, 3, 2]``)::

    sequential: [5] [6] [3 2]        pads 3 + 2 + 3 = 8
    best_fit:   [6 2] [5 3]          pads 0 + 0     = 0   (window >= 4)

Output is a :class:`PackPlan` (piece arrays + pack offsets), identical for identical inputs.

Legend: D documents, Q pieces (documents after over-long handling), P packs.
"""

import bisect
import dataclasses
from typing import Literal

import numpy as np

PackingAlgorithm = Literal["sequential", "best_fit"]
PACKING_ALGORITHMS: tuple[str, ...] = ("sequential", "best_fit")
OverlongPolicy = Literal["split", "truncate", "drop"]
OVERLONG_POLICIES: tuple[str, ...] = ("split", "truncate", "drop")


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Pieces of documents in pack order; pack p holds pieces ``pack_offsets_P1[p]:[p+1]``."""

    piece_doc_Q: np.ndarray
    """int64 position of the piece's document in the caller's document array."""
    piece_start_Q: np.ndarray
    """int64 first token of the piece inside its document."""
    piece_len_Q: np.ndarray
    """int64 tokens in the piece (1..capacity)."""
    pack_offsets_P1: np.ndarray
    """int64 [P + 1] offsets into the piece arrays."""
    num_split: int
    """Documents longer than the capacity cut into several pieces."""
    num_truncated: int
    """Documents longer than the capacity cut to their first ``capacity`` tokens."""
    num_dropped: int
    """Documents longer than the capacity left out."""
    num_empty: int
    """Zero-length documents left out (they hold nothing to train on)."""

    @property
    def num_packs(self) -> int:
        return int(self.pack_offsets_P1.size - 1)

    def pack_lengths_P(self) -> np.ndarray:
        """Real tokens in each pack."""
        cum = np.concatenate([[0], np.cumsum(self.piece_len_Q)])
        return cum[self.pack_offsets_P1[1:]] - cum[self.pack_offsets_P1[:-1]]


def cut_overlong(
    doc_lens_D: np.ndarray, capacity: int, policy: OverlongPolicy
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """Turns documents into pieces of at most ``capacity`` tokens.

    Args:
        doc_lens_D: Token count of each document.
        capacity: Most tokens in a pack (the sequence length).
        policy: ``split`` | ``truncate`` | ``drop`` for documents longer than ``capacity``.

    Returns:
        ``(piece_doc_Q, piece_start_Q, piece_len_Q, counts)``; pieces in document order, counts
        has ``num_split``, ``num_truncated``, ``num_dropped``, ``num_empty``.
    """
    if capacity < 1:
        raise ValueError(f"--seq-length must be >= 1, got {capacity}")
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"unknown --pack-overlong-policy {policy!r}; choose {OVERLONG_POLICIES}")
    doc_lens_D = np.asarray(doc_lens_D, dtype=np.int64)
    if doc_lens_D.size and doc_lens_D.min() < 0:
        raise ValueError("document lengths must be >= 0")
    overlong_D = doc_lens_D > capacity
    counts = {"num_split": 0, "num_truncated": 0, "num_dropped": 0}
    counts["num_empty"] = int((doc_lens_D == 0).sum())
    if policy == "split":
        n_pieces_D = -(-doc_lens_D // capacity)  # 0 for empty documents
        counts["num_split"] = int(overlong_D.sum())
        piece_doc_Q = np.repeat(np.arange(doc_lens_D.size, dtype=np.int64), n_pieces_D)
        first_piece_D = np.cumsum(n_pieces_D) - n_pieces_D
        piece_rank_Q = np.arange(piece_doc_Q.size, dtype=np.int64) - first_piece_D[piece_doc_Q]
        piece_start_Q = piece_rank_Q * capacity
        piece_len_Q = np.minimum(capacity, doc_lens_D[piece_doc_Q] - piece_start_Q)
        return piece_doc_Q, piece_start_Q, piece_len_Q, counts
    keep_D = doc_lens_D > 0
    if policy == "drop":
        keep_D &= ~overlong_D
        counts["num_dropped"] = int(overlong_D.sum())
    else:
        counts["num_truncated"] = int(overlong_D.sum())
    piece_doc_Q = np.flatnonzero(keep_D).astype(np.int64)
    piece_len_Q = np.minimum(doc_lens_D[piece_doc_Q], capacity)
    return piece_doc_Q, np.zeros_like(piece_doc_Q), piece_len_Q, counts


def next_fit_offsets(piece_len_Q: np.ndarray, capacity: int) -> np.ndarray:
    """Pack offsets of next-fit packing in the given order (each piece <= capacity).

    One ``searchsorted`` per pack: a pack starting at piece i ends before the first piece
    whose cumulative length exceeds ``cum[i] + capacity``.
    """
    cum_Q1 = np.concatenate([[0], np.cumsum(piece_len_Q, dtype=np.int64)])
    offsets = [0]
    while offsets[-1] < piece_len_Q.size:
        start = offsets[-1]
        end = int(np.searchsorted(cum_Q1, cum_Q1[start] + capacity, side="right")) - 1
        offsets.append(max(end, start + 1))
    return np.asarray(offsets, dtype=np.int64)


def best_fit_order(
    piece_len_Q: np.ndarray, capacity: int, window: int
) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit-decreasing inside consecutive windows of ``window`` pieces.

    Packs never span windows, so a piece stays within ``window`` of its input position.
    Ties (equal lengths, equal room) break by input position / pack creation order, so the
    result is deterministic.

    Returns:
        ``(order_Q, pack_offsets_P1)``: piece permutation in pack order, and pack offsets.
    """
    if window < 1:
        raise ValueError(f"--packing-window must be >= 1, got {window}")
    order: list[np.ndarray] = []
    offsets = [0]
    for w0 in range(0, piece_len_Q.size, window):
        lens = piece_len_Q[w0 : w0 + window]
        by_len = np.argsort(-lens, kind="stable")
        # Open packs keyed by (room, creation id): bisect finds the tightest one that fits.
        rooms: list[tuple[int, int]] = []
        members: list[list[int]] = []
        for i in by_len.tolist():
            need = int(lens[i])
            j = bisect.bisect_left(rooms, (need, -1))
            if j == len(rooms):
                members.append([i])
                bisect.insort(rooms, (capacity - need, len(members) - 1))
            else:
                room, pack = rooms.pop(j)
                members[pack].append(i)
                bisect.insort(rooms, (room - need, pack))
        for m in members:
            order.append(np.asarray(m, dtype=np.int64) + w0)
            offsets.append(offsets[-1] + len(m))
    order_Q = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
    return order_Q, np.asarray(offsets, dtype=np.int64)


def plan_packs(
    doc_lens_D: np.ndarray,
    capacity: int,
    *,
    algorithm: PackingAlgorithm = "best_fit",
    window: int = 1000,
    overlong: OverlongPolicy = "split",
) -> PackPlan:
    """Plans packs of at most ``capacity`` tokens from documents in the given (shuffled) order.

    Args:
        doc_lens_D: Token count of each document, in packing order.
        capacity: Most real tokens per pack.
        algorithm: ``sequential`` (next-fit) or ``best_fit`` (windowed best-fit-decreasing).
        window: Documents considered together by ``best_fit``.
        overlong: What happens to documents longer than ``capacity``.

    Returns:
        The :class:`PackPlan`.
    """
    if algorithm not in PACKING_ALGORITHMS:
        raise ValueError(f"unknown --packing-algorithm {algorithm!r}; choose {PACKING_ALGORITHMS}")
    piece_doc_Q, piece_start_Q, piece_len_Q, counts = cut_overlong(doc_lens_D, capacity, overlong)
    if algorithm == "sequential":
        offsets_P1 = next_fit_offsets(piece_len_Q, capacity)
    else:
        order_Q, offsets_P1 = best_fit_order(piece_len_Q, capacity, window)
        piece_doc_Q, piece_start_Q, piece_len_Q = (
            piece_doc_Q[order_Q],
            piece_start_Q[order_Q],
            piece_len_Q[order_Q],
        )
    return PackPlan(
        piece_doc_Q=piece_doc_Q,
        piece_start_Q=piece_start_Q,
        piece_len_Q=piece_len_Q,
        pack_offsets_P1=offsets_P1,
        **counts,
    )
