"""Where each token of a micro-batch sits among a router's rows on this rank (pure torch, never
imports megatron): route replay slices a pack's routes with it, pad skipping its pad mask.

A router on one rank sees ``hidden [S_local, B, H]`` flattened to rows ``s * B + b``, where
``S_local`` is this rank's part of the sequence after context parallelism and then sequence
parallelism (TP rank t keeps the t-th contiguous slice). Context parallelism splits as Megatron's
``get_batch_on_this_cp_rank`` does: a sequence without document boundaries by Megatron's
per-sequence zigzag (cut into ``2 * cp`` chunks, CP rank r keeps chunks r and ``2 * cp - 1 - r``);
a packed THD row (``[1, B*S]``, with its ``cu_seqlens``) per document, by Transformer Engine's
``thd_get_partitioned_indices`` (:mod:`megatron_ext.common.thd_partition`).

Worked example: B = 1, S = 8, CP = 2, TP = 2 with SP. Chunks of 2: CP rank 1 keeps chunks 1 and 2,
i.e. positions ``[2 3 4 5]``; TP rank 0 then keeps ``[2 3]`` and TP rank 1 keeps ``[4 5]``. The
same row packed as documents ``cu_seqlens = [0, 4, 8]``: CP rank 1 keeps ``[1 2 5 6]``, TP rank 0
``[1 2]``.

Legend: B samples of a micro-batch, S sequence length, N router rows on this rank.
"""

import torch

from megatron_ext.common.thd_partition import thd_partitioned_indices


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


def cp_positions(
    seq_len: int, cp_size: int, cp_rank: int, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Sequence positions CP rank ``cp_rank`` holds, in its local order (int64, host).

    Args:
        seq_len: S, the full sequence (a THD row: B * S).
        cp_size: Context-parallel size.
        cp_rank: This rank's context-parallel rank.
        cu_seqlens: A THD row's 1-D document boundaries (host, int32): split per document as
            Megatron does with it (Transformer Engine's index); None: per-sequence zigzag.
    """
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
    """For each router row on this rank, its flat position ``b * S + s`` in the micro-batch.

    Args:
        batch_size: B.
        seq_len: S, the full (un-sharded) sequence length.
        cp_size: Context-parallel size.
        cp_rank: This rank's context-parallel rank.
        tp_size: Tensor-parallel size.
        tp_rank: This rank's tensor-parallel rank.
        sequence_parallel: Whether the MoE layer input is scattered along the sequence over TP.
        cu_seqlens: THD only (``batch_size`` 1, ``seq_len`` the row's B * S): the row's 1-D
            document boundaries on the host; CP then splits per document (:func:`cp_positions`).

    Returns:
        ``positions_N`` (int64), N = B * S / cp (/ tp with SP), in router row order ``s * B + b``.

    Raises:
        ValueError: The local sequence does not split evenly over TP ranks.
    """
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
        piece = local_len // tp_size
        seq_positions = seq_positions[tp_rank * piece : (tp_rank + 1) * piece]
    batch = torch.arange(batch_size)
    # Router rows are s-major (hidden is [s, b, h]); positions in the data layout are b-major.
    return (batch.unsqueeze(0) * seq_len + seq_positions.unsqueeze(1)).reshape(-1)
