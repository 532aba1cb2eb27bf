"""Where each token of a micro-batch sits among a router's rows on this rank (pure torch, never
imports megatron): route replay slices a pack's routes with it, pad skipping its pad mask.

A router sees ``hidden [S_local, B, H]`` as rows ``s * B + b``, ``S_local`` this rank's part after
context parallelism (Megatron's per-sequence zigzag, or per document for a THD row), then sequence
parallelism. B = 1, S = 8, CP = 2, TP = 2 with SP: CP rank 1 keeps ``[2 3 4 5]``, TP rank 0
``[2 3]``; as a THD row with ``cu_seqlens = [0, 4, 8]``: ``[1 2 5 6]``, then ``[1 2]``.

Legend: B samples of a micro-batch, S sequence length, N router rows on this rank.
"""

import torch

from megatron_ext.common.thd_partition import thd_partitioned_indices


def cp_zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Sequence positions CP rank ``cp_rank`` holds under Megatron's per-sequence zigzag: chunks
    r and ``2 * cp - 1 - r`` of ``2 * cp`` (``seq_len`` must divide)."""
    if cp_size == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} must be divisible by 2 * --context-parallel-size "
            f"({2 * cp_size}) for zigzag context parallelism"
        )
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_chunk = 2 * cp_size - 1 - cp_rank
    second = torch.arange(second_chunk * chunk, (second_chunk + 1) * chunk)
    return torch.cat([first, second])


def cp_positions(
    seq_len: int, cp_size: int, cp_rank: int, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Sequence positions CP rank ``cp_rank`` holds of ``seq_len`` (a THD row: B * S), in its
    local order (int64, host); ``cu_seqlens`` (a THD row's, host int32): split per document as
    Megatron does with it, else the per-sequence zigzag."""
    if cu_seqlens is None or cp_size == 1:
        return cp_zigzag_positions(seq_len, cp_size, cp_rank)
    return thd_partitioned_indices(cu_seqlens, seq_len, cp_size, cp_rank).to(torch.int64)


def router_row_positions(
    batch_size: int,
    seq_len: int,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    sequence_parallel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """``positions_N`` (int64, N = B * S / cp, / tp with SP): each router row's flat position
    ``b * S + s`` in the micro-batch, in router row order ``s * B + b``. ``seq_len``: the full
    sequence; ``cu_seqlens``: a THD row's host boundaries (batch 1, ``seq_len`` B * S)."""
    if cu_seqlens is not None and batch_size != 1:
        raise ValueError(f"cu_seqlens describes one THD row: batch size 1, got {batch_size}")
    seq_positions = cp_positions(seq_len, cp_size, cp_rank, cu_seqlens)
    if sequence_parallel and tp_size > 1:
        local_len = seq_positions.numel()
        if local_len % tp_size:
            raise ValueError(
                f"local sequence length {local_len} must be divisible by "
                f"--tensor-model-parallel-size ({tp_size}) with --sequence-parallel"
            )
        piece = local_len // tp_size  # TP rank t keeps the t-th contiguous slice
        seq_positions = seq_positions[tp_rank * piece : (tp_rank + 1) * piece]
    batch = torch.arange(batch_size)
    # Router rows are s-major (hidden is [s, b, h]); positions in the data layout are b-major.
    return (batch.unsqueeze(0) * seq_len + seq_positions.unsqueeze(1)).reshape(-1)
