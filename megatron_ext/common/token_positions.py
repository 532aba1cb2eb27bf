"""Where each token of a micro-batch sits among a router's rows on this rank (pure torch, never
imports megatron): route replay slices a pack's routes with it, pad skipping its pad mask.

A router on one rank sees ``hidden [S_local, B, H]`` flattened to rows ``s * B + b``, where
``S_local`` is this rank's part of the sequence after context parallelism (Megatron's per-sequence
zigzag: the sequence is cut into ``2 * cp`` chunks and CP rank r keeps chunks r and
``2 * cp - 1 - r``) and then sequence parallelism (TP rank t keeps the t-th contiguous slice).

Worked example: B = 1, S = 8, CP = 2, TP = 2 with SP. Chunks of 2: CP rank 1 keeps chunks 1 and 2,
i.e. positions ``[2 3 4 5]``; TP rank 0 then keeps ``[2 3]`` and TP rank 1 keeps ``[4 5]``.

Legend: B samples of a micro-batch, S sequence length, N router rows on this rank.
"""

import torch


def cp_zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Sequence positions CP rank ``cp_rank`` holds under Megatron's per-sequence zigzag.

    Raises:
        ValueError: ``seq_len`` not divisible by ``2 * cp_size``.
    """
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


def router_row_positions(
    batch_size: int,
    seq_len: int,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """For each router row on this rank, its flat position ``b * S + s`` in the micro-batch.

    Args:
        batch_size: B.
        seq_len: S, the full (un-sharded) sequence length.
        cp_size: Context-parallel size.
        cp_rank: This rank's context-parallel rank.
        tp_size: Tensor-parallel size.
        tp_rank: This rank's tensor-parallel rank.
        sequence_parallel: Whether the MoE layer input is scattered along the sequence over TP.

    Returns:
        ``positions_N`` (int64), N = B * S / cp (/ tp with SP), in router row order ``s * B + b``.

    Raises:
        ValueError: The local sequence does not split evenly over TP ranks.
    """
    seq_positions = cp_zigzag_positions(seq_len, cp_size, cp_rank)
    if sequence_parallel and tp_size > 1:
        local_len = seq_positions.numel()
        if local_len % tp_size:
            raise ValueError(
                f"local sequence length {local_len} must be divisible by "
                f"--tensor-model-parallel-size ({tp_size}) with --sequence-parallel"
            )
        piece = local_len // tp_size
        seq_positions = seq_positions[tp_rank * piece : (tp_rank + 1) * piece]
    batch = torch.arange(batch_size)
    # Router rows are s-major (hidden is [s, b, h]); positions in the data layout are b-major.
    return (batch.unsqueeze(0) * seq_len + seq_positions.unsqueeze(1)).reshape(-1)
