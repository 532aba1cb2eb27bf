"""Tier: one gloo rank (Megatron parallel state). Record mode's gather back to ``[B, S, L, K]``.

The multi-rank gathers (SP, CP, PP) run in tests/replay/test_binding.py and
test_binding_pipeline.py through ``RouteReplayBinding.recorded_routes``.
"""

import torch

from megatron_ext.testing import run_distributed


def _gather(batch_size: int, seq_len: int) -> dict:
    from megatron_ext.replay.layout import router_row_positions
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
