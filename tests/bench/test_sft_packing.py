"""Tests for megatron_ext.bench.sft_packing. Tier: pure (numpy and the pack kernel; the quick run)."""

import numpy as np

from megatron_ext.bench.sft_packing import CONTEXT_PARALLEL_SIZES, filled_lines, sft_packing


def test_filled_lines_end_at_the_conversation_that_reaches_the_length() -> None:
    # seq 8: [3 4] stays under, 5 crosses -> line [3 4 5]; [9] crosses alone; [2] is the rest.
    assert filled_lines(np.array([3, 4, 5, 9, 2]), 8).tolist() == [0, 3, 4, 5]
    assert filled_lines(np.array([8]), 8).tolist() == [0, 1]


def test_quick_run_ours_lose_nothing_megatrons_rule_does() -> None:
    result = sft_packing(quick=True)
    rows = {(r[0], r[1]): r for r in result.rows}
    assert len(rows) == len(result.rows) == 4 * len(CONTEXT_PARALLEL_SIZES)
    for cp in CONTEXT_PARALLEL_SIZES:
        ours = rows[(cp, "ours: --sft-packing packed, best_fit")]
        filled = rows[(cp, "Megatron SFTDataset rule, lines filled to seq_length")]
        assert ours[4] == 0 and filled[4] > 0.2  # tokens lost
        assert ours[3] < 0.02 and ours[5] > 0  # pad fraction, a timed build
    # Per-conversation CP pads grow with CP, for both rules.
    pads = [rows[(cp, "ours: --sft-packing packed, best_fit")][3] for cp in CONTEXT_PARALLEL_SIZES]
    assert pads == sorted(pads) and pads[0] < pads[-1]
