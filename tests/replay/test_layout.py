"""Tier: pure (torch only). Router-row layout under CP zigzag and SP, MoE layer numbering."""

import argparse

import pytest
import torch

from megatron_ext.common.token_positions import router_row_positions
from megatron_ext.replay.layout import (
    assemble_from_ranks,
    moe_layer_numbers,
    moe_layer_numbers_for_args,
    moe_layer_numbers_from_hybrid_pattern,
    rows_for_router,
    stage_rows_layer_major,
)


def _loop_reference(batch, seq, cp, cp_rank, tp, tp_rank, sp):
    chunk = seq // (2 * cp)
    seq_pos = list(range(cp_rank * chunk, (cp_rank + 1) * chunk))
    seq_pos += list(range((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk))
    if sp:
        piece = len(seq_pos) // tp
        seq_pos = seq_pos[tp_rank * piece : (tp_rank + 1) * piece]
    return [b * seq + s for s in seq_pos for b in range(batch)]


@pytest.mark.parametrize(
    "cp, tp, sp",
    [(1, 1, False), (2, 1, False), (1, 2, True), (2, 2, True), (4, 2, True), (2, 4, False)],
)
def test_ranks_partition_the_micro_batch_and_match_a_loop(cp, tp, sp):
    batch, seq = 3, 32
    routes_BSLK = torch.randint(0, 200, (batch, seq, 2, 2), dtype=torch.uint8)
    rows, positions = [], []
    for cp_rank in range(cp):
        for tp_rank in range(tp if sp else 1):
            pos = router_row_positions(
                batch,
                seq,
                cp_size=cp,
                cp_rank=cp_rank,
                tp_size=tp,
                tp_rank=tp_rank,
                sequence_parallel=sp,
            )
            assert pos.tolist() == _loop_reference(batch, seq, cp, cp_rank, tp, tp_rank, sp)
            positions.append(pos)
            rows.append(rows_for_router(routes_BSLK, pos))
    positions_RN = torch.stack(positions)
    assert sorted(positions_RN.reshape(-1).tolist()) == list(range(batch * seq))
    rebuilt = assemble_from_ranks(torch.stack(rows), positions_RN, batch, seq)
    assert torch.equal(rebuilt, routes_BSLK)


def test_stage_rows_are_the_router_rows_of_the_stage_layers_layer_major():
    routes_BSLK = torch.randint(0, 255, (2, 8, 5, 2), dtype=torch.uint8)
    kw = {"cp_size": 2, "cp_rank": 1, "tp_size": 2, "tp_rank": 1, "sequence_parallel": True}
    positions = router_row_positions(2, 8, **kw)
    rows_LNK = stage_rows_layer_major(routes_BSLK, positions, 1, 4)
    expected = rows_for_router(routes_BSLK, positions)[:, 1:4].transpose(0, 1)
    assert rows_LNK.shape == (3, 4, 2) and rows_LNK.dtype == torch.uint8
    assert rows_LNK.is_contiguous() and torch.equal(rows_LNK, expected)


def test_moe_layer_numbers():
    assert moe_layer_numbers(4, 1) == [1, 2, 3, 4]
    assert moe_layer_numbers(5, 2) == [1, 3, 5]
    assert moe_layer_numbers(4, [0, 1, 1, 0]) == [2, 3]
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        moe_layer_numbers(3, [1, 0])


def test_moe_layer_numbers_from_hybrid_pattern():
    assert moe_layer_numbers_from_hybrid_pattern("*E*E") == [2, 4]
    # '|' (pipeline stages) takes no layer number; the MTP part after '/' is not the decoder.
    assert moe_layer_numbers_from_hybrid_pattern("*E|*E/*E/*E") == [2, 4]
    assert moe_layer_numbers_from_hybrid_pattern("M-M*|EE") == [5, 6]
    assert moe_layer_numbers_from_hybrid_pattern("M*-") == []
    with pytest.raises(ValueError, match=r"--hybrid-layer-pattern .*\['x'\]"):
        moe_layer_numbers_from_hybrid_pattern("*x*E")


def test_moe_layer_numbers_for_args_follows_the_model_kind():
    gpt = argparse.Namespace(
        hybrid_layer_pattern=None, num_layers=4, moe_layer_freq=[0, 1, 1, 1], num_experts=8
    )
    assert moe_layer_numbers_for_args(gpt) == [2, 3, 4]
    hybrid = argparse.Namespace(**{**vars(gpt), "hybrid_layer_pattern": "*E*E"})
    assert moe_layer_numbers_for_args(hybrid) == [2, 4]  # not moe_layer_freq's [2, 3, 4]
    legacy = argparse.Namespace(**{**vars(gpt), "hybrid_override_pattern": "E*E*"})
    assert moe_layer_numbers_for_args(legacy) == [1, 3]  # before validate_args copies it over
    dense = argparse.Namespace(**{**vars(gpt), "num_experts": None})
    assert moe_layer_numbers_for_args(dense) == []
