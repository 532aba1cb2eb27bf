"""Tier: pure (numpy). LogprobRecorder: a pack's per-position log-probs back at their documents'
tokens, hand-worked (layout in each comment)."""

import numpy as np
import pytest

from megatron_ext.training.logprob_record import LogprobRecorder

LENGTHS = np.array([2, 1, 1, 1, 3, 1, 1, 12])
PIECES = (np.array([4, 7]), np.array([0, 10]), np.array([3, 2]))  # doc 4 [0, 3), doc 7 [10, 12)


@pytest.mark.parametrize(
    ("doc_multiple", "doc4", "doc7_tail"),
    [
        # positions 0 1 2 | 3 4 | 5 6 (pads): l0 predicts doc 4's token 1, l1 its token 2; l2
        # predicts across the boundary (unused); l3 predicts doc 7's token 11.
        (1, [0.0, 0.0, 1.0], [0.0, 3.0]),
        # per-document slots of 4: doc 4 at 0 1 2 (3: its pad), doc 7 at 4 5: l4 -> token 11.
        (4, [0.0, 0.0, 1.0], [0.0, 4.0]),
    ],
)
def test_a_pack_goes_back_to_its_documents_tokens(doc_multiple, doc4, doc7_tail) -> None:
    recorder = LogprobRecorder(LENGTHS)
    recorder.add_pack(PIECES, np.arange(8, dtype=np.float32), doc_multiple)
    docs = list(recorder.documents())
    assert [d.size for d in docs] == LENGTHS.tolist() and docs[0].dtype == np.float32
    assert docs[4].tolist() == doc4  # a piece's first token keeps 0
    assert docs[7][:10].tolist() == [0.0] * 10 and docs[7][10:].tolist() == doc7_tail
    assert sum(d.sum() for i, d in enumerate(docs) if i not in (4, 7)) == 0  # never recorded


def test_a_document_recorded_twice_keeps_the_merged_recording() -> None:
    first, second = LogprobRecorder(LENGTHS), LogprobRecorder(LENGTHS)
    first.add_pack(PIECES, np.full(7, -1.0, np.float32))
    second.add_pack(((np.array([4])), np.array([0]), np.array([3])), np.full(3, -2.0, np.float32))
    first.merge(second.values)
    docs = list(first.documents())
    assert docs[4].tolist() == [0.0, -2.0, -2.0] and docs[7][11] == -1.0
