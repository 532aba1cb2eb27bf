"""Per-token log-probs recorded per pack, put back at their documents' tokens (pure numpy, never
imports megatron): what ``--rl-record-logprobs`` writes beside the recorded routes.

The loss at pack position p is the trainer's log-prob of the token at p + 1 (its label), so a
piece's token i >= 1 gets the value computed at the position before it; a piece's first token has
no context inside the pack and keeps 0 (a document's first token, or the first token of a split
document's later piece, which the training packs never predict either)::

    piece (doc 4, start 0, len 3) at positions 0..2, logp_S = [l0 l1 l2 ...]
    document 4 -> [0, l0, l1]            (l2 predicts the next piece's token: not this piece's)

Values are kept in host memory, 4 bytes per token of every recorded document (a validation
recording, not a corpus-scale one).

Legend: S positions of a pack, Q pieces, N real tokens, D documents.
"""

from collections.abc import Iterator

import numpy as np

from megatron_ext.data.padding import real_positions


class LogprobRecorder:
    """Recorded per-token values of the documents of one token dataset.

    Args:
        doc_lengths_D: Token count of every document (may be memory-mapped).
    """

    def __init__(self, doc_lengths_D: np.ndarray) -> None:
        self.doc_lengths = doc_lengths_D
        #: Document -> its values (float32, one per token), for every document recorded.
        self.values: dict[int, np.ndarray] = {}

    def add_pack(
        self,
        pieces: tuple[np.ndarray, np.ndarray, np.ndarray],
        logp_S: np.ndarray,
        doc_multiple: int = 1,
    ) -> None:
        """Records one pack: ``logp_S[p]`` (the log-prob of the label at p) goes to the token
        after p in its piece.

        Args:
            pieces: ``(doc_Q, start_Q, len_Q)`` of the pack.
            logp_S: The pack's per-position log-probs.
            doc_multiple: The pack's per-document pad multiple (where its real tokens sit).
        """
        doc_Q, start_Q, len_Q = (np.asarray(a, dtype=np.int64) for a in pieces)
        real_N = real_positions(len_Q, doc_multiple)
        assert real_N.size == 0 or real_N[-1] < logp_S.shape[0], "fewer log-probs than tokens"
        first = 0
        for doc, start, length in zip(
            doc_Q.tolist(), start_Q.tolist(), len_Q.tolist(), strict=True
        ):
            positions = real_N[first : first + length]
            first += length
            if length < 2:
                continue
            values = self.values.get(doc)
            if values is None:
                values = self.values[doc] = np.zeros(int(self.doc_lengths[doc]), np.float32)
            values[start + 1 : start + length] = logp_S[positions[:-1]]

    def merge(self, values: dict[int, np.ndarray]) -> None:
        """Adds another recorder's documents; a document recorded by both keeps ``values``'."""
        self.values.update(values)

    def documents(self) -> Iterator[np.ndarray]:
        """Every document's values in order (zeros for one never recorded)."""
        for doc, length in enumerate(np.asarray(self.doc_lengths).tolist()):
            values = self.values.get(doc)
            yield np.zeros(length, np.float32) if values is None else values
