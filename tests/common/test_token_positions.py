"""Tier: pure (torch). Where each token of a micro-batch sits among a router's rows: hand-worked
layouts under context and sequence parallelism, compared exactly, and every rank's rows together
covering the micro-batch once."""

import pytest
import torch

from megatron_ext.common.token_positions import cp_zigzag_positions, router_row_positions
from tests.import_probe import imported_from


def test_common_never_imports_megatron_or_a_feature_package() -> None:
    assert (
        imported_from(
            [
                "megatron_ext.common.token_positions",
                "megatron_ext.common.device_copy",
                "megatron_ext.common.safe_files",
            ],
            ["megatron", *(f"megatron_ext.{f}" for f in ("data", "moe", "replay", "training"))],
        )
        == []
    )


def test_hand_worked_zigzag_and_sequence_parallel_slice() -> None:
    # S = 8, CP = 2: chunks of 2; CP rank 1 keeps chunks 1 and 2 -> [2 3 4 5]; TP 2 with SP
    # splits that: TP rank 0 [2 3], TP rank 1 [4 5].
    assert cp_zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    cp1 = dict(cp_size=2, cp_rank=1, tp_size=2, sequence_parallel=True)
    assert router_row_positions(1, 8, tp_rank=0, **cp1).tolist() == [2, 3]
    assert router_row_positions(1, 8, tp_rank=1, **cp1).tolist() == [4, 5]
    # B = 2 without parallelism: rows are s-major (s * B + b), positions b-major (b * S + s).
    assert router_row_positions(2, 3).tolist() == [0, 3, 1, 4, 2, 5]
    # TP without SP: every TP rank sees the whole local sequence.
    assert router_row_positions(1, 4, tp_size=2, tp_rank=1).tolist() == [0, 1, 2, 3]


def test_every_rank_together_holds_each_position_once() -> None:
    batch, seq, cp, tp = 3, 16, 2, 2
    rows = [
        router_row_positions(
            batch, seq, cp_size=cp, cp_rank=c, tp_size=tp, tp_rank=t, sequence_parallel=True
        )
        for c in range(cp)
        for t in range(tp)
    ]
    assert all(r.numel() == batch * seq // (cp * tp) for r in rows)
    assert torch.equal(torch.cat(rows).sort().values, torch.arange(batch * seq))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(seq_len=6, cp_size=2), "divisible by 2 \\* --context-parallel-size"),
        (dict(seq_len=6, tp_size=4, sequence_parallel=True), "--tensor-model-parallel-size"),
    ],
)
def test_uneven_splits_are_refused_naming_the_flag(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        router_row_positions(1, **kwargs)


def test_a_packed_row_splits_per_document() -> None:
    # THD row [0 4 8]: documents of 4 in chunks of 1; CP rank 1 keeps chunks 1 and 2 of each ->
    # [1 2 5 6] (the zigzag of the whole row would be [2 3 4 5]); TP rank 0 with SP keeps [1 2].
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    assert router_row_positions(1, 8, cp_size=2, cp_rank=1, cu_seqlens=cu).tolist() == [1, 2, 5, 6]
    sp = dict(cp_size=2, cp_rank=1, tp_size=2, tp_rank=0, sequence_parallel=True)
    assert router_row_positions(1, 8, cu_seqlens=cu, **sp).tolist() == [1, 2]
    # Every (CP, TP) rank together: each position once.
    cu = torch.tensor([0, 8, 12, 12, 16, 24, 32], dtype=torch.int32)
    rows = [
        router_row_positions(
            1, 32, cp_size=2, cp_rank=c, tp_size=2, tp_rank=t, sequence_parallel=True, cu_seqlens=cu
        )
        for c in range(2)
        for t in range(2)
    ]
    assert torch.equal(torch.cat(rows).sort().values, torch.arange(32))
    with pytest.raises(ValueError, match="batch size 1"):
        router_row_positions(2, 16, cp_size=2, cu_seqlens=cu)
