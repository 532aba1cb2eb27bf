"""Record mode's output: one micro-batch's recorded top-k, gathered back to the data layout.

Each rank holds its router rows ``[N, K]`` of its stage's layers; the sidecar needs the whole
micro-batch ``[B, S, L, K]``: rows all-gathered over SP (the TP group) and CP and put back by each
rank's router-row positions, other stages' layers gathered over PP. Layers nobody recorded keep the
missing marker.
"""

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state

from megatron_ext.replay.layout import assemble_from_ranks
from megatron_ext.replay.routes import route_dtype

#: ``(batch_size, seq_len, tp_rank, cp_rank) -> positions_N`` (the binding's cached index).
RowPositions = Callable[[int, int, int, int], torch.Tensor]


def gather_recorded_routes(
    recorded: dict[int, torch.Tensor],
    batch_size: int,
    seq_len: int,
    *,
    num_layers: int,
    topk: int,
    num_experts: int,
    sequence_parallel: bool,
    row_positions: RowPositions,
) -> torch.Tensor:
    """The recorded routes of one micro-batch as ``[B, S, L, K]`` (uint8 or uint16).

    ``recorded``: this rank's rows ``[N, K]`` per MoE ordinal of its stage; ``num_layers``: the
    whole model's L; ``row_positions``: a rank's rows' positions in the micro-batch.

    NOTE: device-to-host sync (PP gather of Python objects); record mode only, not a hot path.
    """
    dtype = torch.uint8 if route_dtype(num_experts, topk) == np.uint8 else torch.uint16
    sharing = parallel_state.get_context_parallel_world_size()
    if sequence_parallel:
        sharing *= parallel_state.get_tensor_model_parallel_world_size()
    # Layers of other stages (and any not recorded) start as the missing marker.
    rows_NLK = torch.full(
        (batch_size * seq_len // sharing, num_layers, topk),
        torch.iinfo(dtype).max,
        dtype=torch.int64,
    )
    for ordinal, rows_NK in recorded.items():
        rows_NLK[:, ordinal] = rows_NK.to(rows_NLK.device)
    rows_RNLK, positions_RN = _gather_rows(
        rows_NLK, batch_size, seq_len, sequence_parallel, row_positions
    )
    routes_BSLK = assemble_from_ranks(rows_RNLK, positions_RN, batch_size, seq_len)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # each stage's own layers
        stages: list[Any] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        torch.distributed.all_gather_object(
            stages,
            (list(recorded), routes_BSLK.cpu()),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        for ordinals, stage_routes in stages:
            routes_BSLK[:, :, ordinals] = stage_routes[:, :, ordinals].to(routes_BSLK.device)
    return routes_BSLK.to(dtype)


def _gather_rows(
    rows_NLK: torch.Tensor,
    batch_size: int,
    seq_len: int,
    sequence_parallel: bool,
    row_positions: RowPositions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gathers router rows over SP (TP group) then CP; returns rows and positions."""
    tp_ranks = [parallel_state.get_tensor_model_parallel_rank()]
    if sequence_parallel:
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        gathered = [torch.empty_like(rows_NLK) for _ in range(tp_size)]
        torch.distributed.all_gather(
            gathered, rows_NLK, group=parallel_state.get_tensor_model_parallel_group()
        )
        rows_TNLK, tp_ranks = torch.stack(gathered), list(range(tp_size))
    else:
        rows_TNLK = rows_NLK.unsqueeze(0)
    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size > 1:
        gathered = [torch.empty_like(rows_TNLK) for _ in range(cp_size)]
        torch.distributed.all_gather(
            gathered, rows_TNLK, group=parallel_state.get_context_parallel_group()
        )
        rows_CTNLK = torch.stack(gathered)
    else:
        rows_CTNLK = rows_TNLK.unsqueeze(0)
    cp_ranks = range(cp_size) if cp_size > 1 else [parallel_state.get_context_parallel_rank()]
    positions_RN = torch.stack(
        [row_positions(batch_size, seq_len, t, c) for c in cp_ranks for t in tp_ranks]
    )
    return rows_CTNLK.reshape(-1, *rows_NLK.shape), positions_RN
