"""Pack planning: which document pieces go into which pack (pure numpy; never imports megatron).

Over-long documents are ``split``, ``truncate``d or ``drop``ped (and counted), then the pieces are
packed ``sequential``ly (next-fit in the shuffled order) or ``best_fit`` (best-fit-decreasing
within each window: fewer pads; the window bounds how far a document moves). Capacity 8, lengths
``[5, 6, 3, 2]``::

    sequential: [5] [6] [3 2]        pads 3 + 2 + 3 = 8
    best_fit:   [6 2] [5 3]          pads 0 + 0     = 0   (window >= 4)

Legend: D documents, Q pieces (documents after over-long handling), P packs, L over-long
documents, R the pieces of those.
"""

import bisect
import ctypes
import dataclasses
from typing import Literal

import numpy as np

from megatron_ext.data import pack_kernel

PackingAlgorithm = Literal["sequential", "best_fit"]
PACKING_ALGORITHMS: tuple[str, ...] = ("sequential", "best_fit")
OverlongPolicy = Literal["split", "truncate", "drop"]
OVERLONG_POLICIES: tuple[str, ...] = ("split", "truncate", "drop")
#: Above this capacity the kernel's one-bucket-per-room table (8 B per room) is not worth it.
MAX_KERNEL_CAPACITY = 1 << 22


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
    """Turns documents into pieces of at most ``capacity`` tokens, over-long ones by ``policy``.

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
    counts["num_empty"] = int(doc_lens_D.size - np.count_nonzero(doc_lens_D))
    if policy == "split":
        # Every document with tokens gives a piece at 0 (one pass over the pieces each for the
        # document, start and length); the later pieces of over-long documents (few) are then
        # filled in from small per-split-document arrays.
        long_D = np.flatnonzero(overlong_D)
        counts["num_split"] = int(long_D.size)
        n_pieces_D = np.minimum(doc_lens_D, 1)  # lengths are >= 0
        n_long_L = -(-doc_lens_D[long_D] // capacity)
        n_pieces_D[long_D] = n_long_L
        piece_doc_Q = np.repeat(np.arange(doc_lens_D.size, dtype=np.int64), n_pieces_D)
        piece_start_Q = np.zeros_like(piece_doc_Q)
        piece_len_Q = doc_lens_D[piece_doc_Q]
        np.minimum(piece_len_Q, capacity, out=piece_len_Q)
        if long_D.size:
            first_L = np.cumsum(n_pieces_D)[long_D] - n_long_L
            rank_R = np.arange(int(n_long_L.sum())) - np.repeat(
                np.cumsum(n_long_L) - n_long_L, n_long_L
            )
            at_R = np.repeat(first_L, n_long_L) + rank_R
            piece_start_Q[at_R] = rank_R * capacity
            piece_len_Q[at_R] = np.minimum(
                capacity, doc_lens_D[piece_doc_Q[at_R]] - rank_R * capacity
            )
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
    """Pack offsets of next-fit packing in the given order (each piece 1..capacity tokens)."""
    piece_len_Q = _checked_lengths(piece_len_Q, capacity)
    lib = _kernel(capacity, piece_len_Q.size)
    if lib is None:
        return next_fit_offsets_python(piece_len_Q, capacity)
    return pack_kernel.next_fit(lib, piece_len_Q, capacity)


def next_fit_offsets_python(piece_len_Q: np.ndarray, capacity: int) -> np.ndarray:
    """:func:`next_fit_offsets` without the compiled kernel (the fallback and the reference)."""
    # One searchsorted per pack: a pack starting at piece i ends before the first piece whose
    # cumulative length exceeds cum[i] + capacity.
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
    """Best-fit-decreasing inside consecutive windows of ``window`` pieces (1..capacity tokens).

    Packs never span windows, so a piece stays within ``window`` of its input position. Ties
    (equal lengths, equal room) break by input position / pack creation order: deterministic.

    Returns:
        ``(order_Q, pack_offsets_P1)``: piece permutation in pack order, and pack offsets.
    """
    if window < 1:
        raise ValueError(f"--packing-window must be >= 1, got {window}")
    piece_len_Q = _checked_lengths(piece_len_Q, capacity)
    lib = _kernel(capacity, piece_len_Q.size)
    if lib is None:
        return best_fit_order_python(piece_len_Q, capacity, window)
    return pack_kernel.best_fit(lib, piece_len_Q, capacity, min(window, max(piece_len_Q.size, 1)))


def best_fit_order_python(
    piece_len_Q: np.ndarray, capacity: int, window: int
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`best_fit_order` without the compiled kernel (the fallback and the reference)."""
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


def _checked_lengths(piece_len_Q: np.ndarray, capacity: int) -> np.ndarray:
    piece_len_Q = np.asarray(piece_len_Q, dtype=np.int64)
    if piece_len_Q.size and (piece_len_Q.min() < 1 or piece_len_Q.max() > capacity):
        raise ValueError(f"piece lengths must lie in 1..{capacity} (cut_overlong makes them so)")
    return piece_len_Q


def _kernel(capacity: int, num_pieces: int) -> ctypes.CDLL | None:
    """The compiled loops (:mod:`~megatron_ext.data.pack_kernel`), or None: then the ``*_python``
    loops kept here run (the same packs, slower; no C compiler needed)."""
    # No pieces: config checks plan nothing, so no compile; too many rooms to bucket cheaply.
    if num_pieces == 0 or capacity > MAX_KERNEL_CAPACITY:
        return None
    return pack_kernel.library()


def pack_order(
    piece_len_Q: np.ndarray, capacity: int, algorithm: PackingAlgorithm, window: int
) -> tuple[np.ndarray | None, np.ndarray]:
    """``(order_Q, pack_offsets_P1)`` of ``algorithm``; ``order_Q`` None: the pieces' own order.

    :func:`plan_packs`' packing step, for callers that compose the permutation with their own.
    """
    if algorithm not in PACKING_ALGORITHMS:
        raise ValueError(f"unknown --packing-algorithm {algorithm!r}; choose {PACKING_ALGORITHMS}")
    if algorithm == "sequential":
        return None, next_fit_offsets(piece_len_Q, capacity)
    return best_fit_order(piece_len_Q, capacity, window)


def shuffle_packs(
    values_Q: np.ndarray, pack_offsets_P1: np.ndarray, order_P: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(values_Q, sizes_P)`` of packs ``order_P[0], order_P[1], ...``: per-piece values (in pack
    order) regrouped in that order, each pack's run kept, and the packs' sizes."""
    num_packs = pack_offsets_P1.size - 1
    if order_P.size != num_packs or (
        num_packs and not 0 <= order_P.min() <= order_P.max() < num_packs
    ):
        raise ValueError(f"order_P must be a permutation of the {num_packs} packs")
    sizes_P = np.diff(pack_offsets_P1)[order_P]
    if int(sizes_P.sum()) != values_Q.size:  # a repeated pack: not a permutation
        raise ValueError(f"order_P must be a permutation of the {num_packs} packs")
    lib = pack_kernel.library() if values_Q.size else None
    if lib is None:
        return shuffle_packs_python(values_Q, pack_offsets_P1, order_P), sizes_P
    return pack_kernel.gather_packs(lib, values_Q, pack_offsets_P1, order_P), sizes_P


def shuffle_packs_python(
    values_Q: np.ndarray, pack_offsets_P1: np.ndarray, order_P: np.ndarray
) -> np.ndarray:
    """The regrouped ``values_Q`` of :func:`shuffle_packs`, without a per-pack loop."""
    sizes_P = np.diff(pack_offsets_P1)[order_P]
    first_P = pack_offsets_P1[order_P] - (np.cumsum(sizes_P) - sizes_P)
    return values_Q[np.repeat(first_P, sizes_P) + np.arange(int(sizes_P.sum()))]


def plan_packs(
    doc_lens_D: np.ndarray,
    capacity: int,
    *,
    algorithm: PackingAlgorithm = "best_fit",
    window: int = 1000,
    overlong: OverlongPolicy = "split",
    doc_multiple: int = 1,
) -> PackPlan:
    """Plans packs of at most ``capacity`` tokens from documents in the given (shuffled) order.

    Args:
        doc_lens_D: Token count of each document, in packing order.
        capacity: Most real tokens per pack.
        algorithm: ``sequential`` (next-fit) or ``best_fit`` (windowed best-fit-decreasing).
        window: Documents considered together by ``best_fit``.
        overlong: What happens to documents longer than ``capacity``.
        doc_multiple: Each piece takes its length rounded up to this (2*CP under CP).
    """
    if algorithm not in PACKING_ALGORITHMS:  # before any work on the lengths
        raise ValueError(f"unknown --packing-algorithm {algorithm!r}; choose {PACKING_ALGORITHMS}")
    if doc_multiple < 1 or capacity % doc_multiple:
        raise ValueError(
            f"--seq-length {capacity} is not a multiple of the per-document pad multiple "
            f"{doc_multiple} (2 * --context-parallel-size)"
        )
    piece_doc_Q, piece_start_Q, piece_len_Q, counts = cut_overlong(doc_lens_D, capacity, overlong)
    slot_len_Q = -(-piece_len_Q // doc_multiple) * doc_multiple
    order_Q, offsets_P1 = pack_order(slot_len_Q, capacity, algorithm, window)
    if order_Q is not None:
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
