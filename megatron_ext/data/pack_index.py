"""Compact pack index: one integer per piece, its start and length derived (pure numpy).

A piece is one *slot* number and the pack offsets are int32 when they fit: about 5 B per document
(int64 (document, start, length) triples would cost 26; Megatron's ``GPTDataset`` index costs 6.6),
and a sample decodes only its own pack. The first piece of document d is slot d; the later pieces
of split documents (few) follow after the D documents, piece r of d starting at ``r * capacity``::

    capacity 4, lengths [3, 10, 0, 4]  ->  slots  d0: 0 | d1: 1, 4 5 | d2: 2 | d3: 3
    slot 5 -> document 1, start 8, length 2;   slot 3 -> document 3, start 0, length 4
    (slot 2 belongs to the empty document: never in an index, its length decodes to 0)

Legend: D documents, M split documents, Q pieces, P packs, L later pieces (a split document's
pieces after its first).
"""

import dataclasses
import functools
from collections.abc import Iterator, Mapping

import numpy as np

#: Version of the on-disk layout (``piece_Q`` slots + ``pack_offsets_P1``); part of the cache key,
#: with the fingerprint of the ``.idx`` lengths decoded against, so an index is never decoded
#: against other lengths or read in another format.
PACK_INDEX_FORMAT = 2
#: Keys a loaded index serves as full arrays (the layout of format 1), for inspection and tests.
PIECE_KEYS = ("piece_doc_Q", "piece_start_Q", "piece_len_Q")

_INT32_MAX = np.iinfo(np.int32).max


def smallest_index_dtype(bound: int) -> type[np.signedinteger]:
    """int32 when every value ``<= bound`` fits, else int64."""
    return np.int32 if bound <= _INT32_MAX else np.int64


@dataclasses.dataclass(frozen=True)
class PieceSlots:
    """The slot numbering of one document set (see the module docstring)."""

    doc_lens_D: np.ndarray
    """Token count of every document (the ``.idx`` sequence lengths; may be memory-mapped)."""
    capacity: int
    """Most tokens per piece (the sequence length)."""
    multi_doc_M: np.ndarray
    """int64 documents with more than one piece, ascending."""
    later_M1: np.ndarray
    """int64 [M + 1]: later pieces (all but the first) of the split documents before m."""

    @classmethod
    def of(cls, doc_lens_D: np.ndarray, capacity: int, split: bool) -> "PieceSlots":
        """Numbering for documents of ``doc_lens_D`` cut at ``capacity`` (``split``: into pieces)."""
        multi_doc_M = np.zeros(0, dtype=np.int64)
        if split:
            multi_doc_M = np.flatnonzero(np.asarray(doc_lens_D) > capacity).astype(np.int64)
        count_M = -(-np.asarray(doc_lens_D)[multi_doc_M].astype(np.int64) // capacity)
        later_M1 = np.concatenate([[0], np.cumsum(count_M - 1)]).astype(np.int64)
        return cls(doc_lens_D, capacity, multi_doc_M, later_M1)

    @property
    def num_slots(self) -> int:
        return int(len(self.doc_lens_D) + self.later_M1[-1])

    def encode(self, doc_Q: np.ndarray, start_Q: np.ndarray) -> np.ndarray:
        """Slots of pieces ``(doc_Q, start_Q)`` (starts multiples of the capacity), int32 if
        every slot fits."""
        # A first piece's slot is its document: only the later pieces need the table.
        slot_Q = np.asarray(doc_Q).astype(smallest_index_dtype(self.num_slots - 1))
        later_Q = np.flatnonzero(start_Q)  # later pieces of split documents: few
        if later_Q.size:
            m_L = np.searchsorted(self.multi_doc_M, np.asarray(doc_Q)[later_Q])
            rank_L = np.asarray(start_Q)[later_Q] // self.capacity
            slot_Q[later_Q] = len(self.doc_lens_D) + self.later_M1[m_L] + rank_L - 1
        return slot_Q

    def decode(self, slot_Q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(doc_Q, start_Q, len_Q)`` int64 of slots (a length < 1: not a piece's slot)."""
        # Piece r of d holds min(capacity, len_d - r * capacity) tokens: what
        # pack_planning.cut_overlong gives under every policy, so no table per document.
        doc_Q = np.array(slot_Q, dtype=np.int64)  # a copy: filled in below
        start_Q = np.zeros_like(doc_Q)
        later_Q = np.flatnonzero(doc_Q >= len(self.doc_lens_D))
        if later_Q.size:
            j_L = doc_Q[later_Q] - len(self.doc_lens_D)
            # The split document m whose run of later slots holds j (later_M1 is its start).
            m_L = np.searchsorted(self.later_M1, j_L, side="right") - 1
            start_Q[later_Q] = (j_L - self.later_M1[m_L] + 1) * self.capacity
            doc_Q[later_Q] = self.multi_doc_M[m_L]
        len_Q = np.minimum(self.capacity, self.doc_lens_D[doc_Q] - start_Q)
        return doc_Q, start_Q, len_Q


class PackIndex(Mapping[str, np.ndarray]):
    """A pack index: pack p holds the pieces of slots ``piece_Q[pack_offsets_P1[p]:[p + 1]]``.

    :meth:`pack_pieces` decodes one pack; as a mapping it also serves :data:`PIECE_KEYS` and
    ``pack_offsets_P1``, for inspection and tests.
    """

    def __init__(self, piece_Q: np.ndarray, pack_offsets_P1: np.ndarray, slots: PieceSlots):
        self.piece_Q = piece_Q
        self.pack_offsets_P1 = pack_offsets_P1
        self.slots = slots

    @property
    def num_packs(self) -> int:
        return int(self.pack_offsets_P1.size - 1)

    def pack_pieces(self, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(doc_Q, start_Q, len_Q)`` of pack ``p``'s pieces, in order."""
        q0, q1 = (int(v) for v in self.pack_offsets_P1[p : p + 2])
        return self.slots.decode(self.piece_Q[q0:q1])

    def problem(self) -> str | None:
        """What makes this index unreadable (bad offsets, a slot out of range), or None."""
        # O(P) and a min/max over the slots; a slot of an empty document decodes to length 0 and
        # is refused when its pack is read.
        off = self.pack_offsets_P1
        if off.ndim != 1 or off.size < 1 or off[0] != 0 or off[-1] != self.piece_Q.size:
            return "pack offsets do not cover the pieces"
        if off.size > 1 and np.diff(off).min() < 1:
            return "a pack without pieces"
        if self.piece_Q.size and (
            self.piece_Q.min() < 0 or self.piece_Q.max() >= self.slots.num_slots
        ):
            return f"a piece slot outside 0..{self.slots.num_slots - 1}"
        return None

    @functools.cached_property  # int64, decoded on first use: 24 B per piece in memory
    def _decoded(self) -> dict[str, np.ndarray]:
        return dict(zip(PIECE_KEYS, self.slots.decode(self.piece_Q), strict=True))

    def __getitem__(self, key: str) -> np.ndarray:
        if key == "pack_offsets_P1":
            return self.pack_offsets_P1
        if key in PIECE_KEYS:
            return self._decoded[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter((*PIECE_KEYS, "pack_offsets_P1"))

    def __len__(self) -> int:
        return len(PIECE_KEYS) + 1
