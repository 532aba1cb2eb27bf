"""Tier: gloo ranks (Megatron parallel state). Record mode's gather back to ``[B, S, L, K]``.

One rank here, and the CP gathers (CP=2, and CP=2 x TP=2 with sequence parallelism) on real
process groups: Megatron's local attention has no context parallelism, so no CPU model can
record under CP; the rows each rank's routers would hold are cut from known routes instead. SP
and PP gathers also run through a real model in tests/replay/test_binding.py and
test_binding_pipeline.py (``RouteReplayBinding.recorded_routes``).
"""

import pytest
import torch

from megatron_ext.testing import run_distributed


def _gather(batch_size: int, seq_len: int) -> dict:
    from megatron_ext.common.token_positions import router_row_positions
    from megatron_ext.replay.recorded_rows import gather_recorded_routes

    order = router_row_positions(batch_size, seq_len)  # router rows are s-major
    rows = {1: torch.randint(0, 8, (batch_size * seq_len, 2))}

    def gather(num_experts: int) -> torch.Tensor:
        return gather_recorded_routes(
            {1: rows[1]},
            batch_size,
            seq_len,
            num_layers=3,
            topk=2,
            num_experts=num_experts,
            sequence_parallel=False,
            row_positions=lambda b, s, t, c: router_row_positions(b, s),
        )

    small, wide = gather(8), gather(300)
    return {"small": small, "wide": wide, "rows": rows[1], "order": order}


def test_one_rank_puts_rows_back_in_sequence_order_and_marks_unrecorded_layers_missing():
    (r,) = run_distributed(_gather, 1, 2, 3)
    small, wide = r["small"], r["wide"]
    assert small.shape == (2, 3, 3, 2) and small.dtype == torch.uint8
    assert wide.dtype == torch.uint16  # 300 experts do not fit a byte
    flat = small.reshape(6, 3, 2)
    assert torch.equal(flat[r["order"], 1].long(), r["rows"])  # router row i -> its token
    assert (flat[:, [0, 2]] == 255).all()  # layers this rank did not record: the missing marker
    assert (wide.reshape(6, 3, 2)[:, [0, 2]] == 65535).all()


def _gather_sharded(batch_size: int, seq_len: int) -> dict:
    """Each rank holds its routers' rows (its CP zigzag chunks, its SP slice) of known routes,
    for MoE layers 0 and 2 of 3; the gather must rebuild the whole micro-batch on every rank."""
    from megatron.core import parallel_state as ps

    from megatron_ext.common.token_positions import router_row_positions
    from megatron_ext.replay.layout import rows_for_router
    from megatron_ext.replay.recorded_rows import gather_recorded_routes

    sp = ps.get_tensor_model_parallel_world_size() > 1

    def positions(b: int, s: int, tp_rank: int, cp_rank: int) -> torch.Tensor:
        return router_row_positions(
            b,
            s,
            cp_size=ps.get_context_parallel_world_size(),
            cp_rank=cp_rank,
            tp_size=ps.get_tensor_model_parallel_world_size(),
            tp_rank=tp_rank,
            sequence_parallel=sp,
        )

    g = torch.Generator().manual_seed(5)  # the same routes on every rank
    routes = torch.randint(0, 8, (batch_size, seq_len, 3, 2), generator=g, dtype=torch.uint8)
    mine = positions(
        batch_size, seq_len, ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
    )
    rows = rows_for_router(routes, mine).long()  # [N, L, K]
    recorded = {0: rows[:, 0], 2: rows[:, 2]}
    got = gather_recorded_routes(
        recorded,
        batch_size,
        seq_len,
        num_layers=3,
        topk=2,
        num_experts=8,
        sequence_parallel=sp,
        row_positions=positions,
    )
    return {"got": got, "routes": routes, "local_rows": int(mine.numel())}


@pytest.mark.parametrize(
    "world, layout", [(2, dict(cp=2)), (4, dict(cp=2, tp=2, sp=True))], ids=["cp2", "cp2_tp2_sp"]
)
def test_cp_and_sp_gathers_rebuild_the_micro_batch(world: int, layout: dict):
    batch_size, seq_len = 2, 16
    for r in run_distributed(_gather_sharded, world, batch_size, seq_len, **layout):
        assert r["local_rows"] == batch_size * seq_len // world  # each rank held only a share
        got, routes = r["got"], r["routes"]
        assert got.shape == routes.shape and got.dtype == torch.uint8
        assert torch.equal(got[:, :, [0, 2]], routes[:, :, [0, 2]])
        assert (got[:, :, 1] == 255).all()  # the layer nobody recorded stays missing
