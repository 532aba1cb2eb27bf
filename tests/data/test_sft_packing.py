"""Tests for megatron_ext.data.sft_packing. Tier: pure (numpy only).

Megatron's rule is checked against a loop that restates ``SFTDataset.__getitem__`` (megatron-core
0.19.2) on lengths, step by step; tests/data/test_sft_dataset.py checks it against Megatron's class
itself on real conversations.
"""

import numpy as np
import pytest

from megatron_ext.data.pack_planning import plan_packs
from megatron_ext.data.sft_packing import (
    line_of_conversations,
    megatron_rule_kept,
    megatron_rule_stats,
    plan_stats,
)
from tests.import_probe import imported_from


def test_module_never_imports_megatron() -> None:
    assert imported_from(["megatron_ext.data.sft_packing"], ["megatron"]) == []


def _megatron_loop(conv_lens: list[int], seq_length: int, cp: int) -> list[int]:
    """Megatron's ``SFTDataset.__getitem__`` on one line, lengths only: extend, pad the running
    length to 2*CP, record the boundary, and on ``len >= seq_length + 1`` cut to ``seq_length``
    and stop. Returns each conversation's kept tokens."""
    pack, kept = 0, []
    for n in conv_lens:
        start = pack
        pack += n
        if cp > 1 and pack % (2 * cp):
            pack += 2 * cp - pack % (2 * cp)
        if pack >= seq_length + 1:
            kept.append(max(0, min(n, seq_length - start)))
            break
        kept.append(n)
    return kept + [0] * (len(conv_lens) - len(kept))


def test_hand_worked_docstring_example() -> None:
    # seq 8, one line [3, 4, 5]: starts 0, 3, 7; the third overflows, 1 of its 5 tokens kept.
    kept = megatron_rule_kept(np.array([3, 4, 5]), np.array([0, 3]), 8)
    assert kept.tolist() == [3, 4, 1]
    stats = megatron_rule_stats(np.array([3, 4, 5]), np.array([0, 3]), 8)
    assert (stats.samples, stats.kept, stats.lost, stats.pads) == (1, 8, 4, 0)


def test_cp_pads_each_conversation_and_drop_after_the_overflow() -> None:
    # seq 8, CP 2 (multiple 4), line [3, 2, 5, 1]: slots 4, 4 fill the sample exactly; the third
    # starts at 8 and keeps nothing, the fourth is never reached.
    kept = megatron_rule_kept(np.array([3, 2, 5, 1]), np.array([0, 4]), 8, doc_multiple=4)
    assert kept.tolist() == [3, 2, 0, 0]
    stats = megatron_rule_stats(np.array([3, 2, 5, 1]), np.array([0, 4]), 8, doc_multiple=4)
    assert (stats.kept, stats.lost, stats.pads) == (5, 6, 3)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_vectorised_rule_equals_megatrons_loop(cp: int) -> None:
    rng = np.random.default_rng(cp)
    counts = rng.integers(1, 6, size=300)
    lens = rng.integers(1, 200, size=int(counts.sum()))
    offsets = np.concatenate([[0], np.cumsum(counts)])
    seq_length = 256
    expected = np.concatenate(
        [
            _megatron_loop(lens[a:b].tolist(), seq_length, cp)
            for a, b in zip(offsets[:-1], offsets[1:], strict=True)
        ]
    )
    kept = megatron_rule_kept(lens, offsets, seq_length, doc_multiple=2 * cp if cp > 1 else 1)
    assert kept.tolist() == expected.tolist()
    # Not vacuous: lines were cut, conversations dropped whole, and others kept whole.
    assert ((kept > 0) & (kept < lens)).any() and (kept == 0).any() and (kept == lens).any()


def test_lines_of_conversations() -> None:
    assert line_of_conversations(np.array([0, 2, 2, 5])).tolist() == [0, 0, 2, 2, 2]


def test_packing_whole_conversations_loses_nothing_where_megatrons_rule_does() -> None:
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 700, size=2000)  # some longer than the sequence: split in pieces
    offsets = np.arange(0, 2001, 4)  # four conversations a line
    for doc_multiple in (1, 4, 16):
        plan = plan_packs(lens, 512, algorithm="best_fit", doc_multiple=doc_multiple)
        ours = plan_stats(lens, plan, 512)
        theirs = megatron_rule_stats(lens, offsets, 512, doc_multiple)
        assert ours.lost == 0 and plan.num_split > 0
        assert theirs.lost > 0.3 * theirs.tokens
        assert ours.kept + ours.pads == ours.samples * 512
        assert ours.pad_fraction < theirs.pad_fraction + 0.05


def test_refuses_a_sequence_length_the_multiple_does_not_divide() -> None:
    with pytest.raises(ValueError, match="--seq-length 10 must be a positive multiple of 4"):
        megatron_rule_kept(np.array([3]), np.array([0, 1]), 10, doc_multiple=4)
    with pytest.raises(ValueError, match="line offsets"):
        megatron_rule_kept(np.array([3, 4]), np.array([0, 1]), 8)


def test_empty_input() -> None:
    assert megatron_rule_kept(np.zeros(0, np.int64), np.array([0]), 8).size == 0
    stats = megatron_rule_stats(np.zeros(0, np.int64), np.array([0]), 8)
    assert (stats.samples, stats.tokens, stats.lost_fraction, stats.pad_fraction) == (0, 0, 0, 0)
