"""Which tokens of a packed (THD) row each context-parallel rank holds (pure torch, never imports
megatron): Transformer Engine's ``thd_get_partitioned_indices``, stood in on a machine without it.

Each segment is cut into ``2 * cp`` chunks; rank r keeps chunks r and ``2 * cp - 1 - r`` (causal
work balanced per document). ``cu_seqlens = [0, 8, 12]``, CP 2: rank 0 holds ``[0 1 6 7 8 11]``.

Legend: D segments (``cu_seqlens`` has D + 1 entries), T tokens of the row, N = T / cp.
"""

import torch


def thd_partitioned_indices(
    cu_seqlens_D1: torch.Tensor, total_tokens: int, world_size: int, rank: int
) -> torch.Tensor:
    """``index_N`` (int32, on ``cu_seqlens_D1``'s device): the positions of the global THD row of
    T ``total_tokens`` that CP rank ``rank`` of ``world_size`` holds, in its local order.

    ValueError for arguments TE's binding refuses, or (a host tensor, read without a device sync)
    a boundary not divisible by ``2 * world_size``.
    """
    # TE's semantics, read in NVIDIA/TransformerEngine 2.x (transformer_engine/common/fused_attn/
    # context_parallel.cu, thd_partition_indices_kernel, and its torch binding in
    # transformer_engine/pytorch/csrc/extensions/attention.cpp; checked at 2.21.0-dev0), as
    # Megatron-Core 0.19.2 calls it (megatron/core/utils.py,
    # _get_batch_on_this_cp_rank_per_document_balancing): every cu_seqlens value divisible by
    # 2 * world_size, documents in order, a zero-length segment contributing nothing.
    if cu_seqlens_D1.dim() != 1 or cu_seqlens_D1.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with 2 or more entries, got {cu_seqlens_D1.shape}"
        )
    if cu_seqlens_D1.dtype != torch.int32:
        raise ValueError(
            f"cu_seqlens must be int32 (as TE's binding checks), got {cu_seqlens_D1.dtype}"
        )
    if not (world_size > 0 and 0 <= rank < world_size):
        raise ValueError(f"CP rank {rank} of {world_size}")
    if total_tokens <= 0 or total_tokens % (2 * world_size):
        raise ValueError(
            f"{total_tokens} tokens: must be a positive multiple of 2 * CP size ({2 * world_size})"
        )
    if cu_seqlens_D1.device.type == "cpu":  # TE asserts it in the kernel; here a clear error
        bad = cu_seqlens_D1[cu_seqlens_D1 % (2 * world_size) != 0]
        if bad.numel():
            raise ValueError(
                f"cu_seqlens value {int(bad[0])} is not divisible by 2 * --context-parallel-size "
                f"({2 * world_size}): every document of a pack must be padded to that multiple"
            )
    # Per output token, as TE's kernel (no loop over documents, no host read, sized by the static
    # total_tokens): its document by a binary search of cu_seqlens / world_size, then its offset
    # in the document's first or second half.
    cu_local = cu_seqlens_D1.to(torch.int64) // world_size  # each segment's share on one rank
    token_N = torch.arange(total_tokens // world_size, device=cu_seqlens_D1.device)
    # TE's binary_search: the last segment whose local start is <= the token (empty ones skipped).
    seg_N = torch.searchsorted(cu_local[1:].contiguous(), token_N, right=True)
    start_N = cu_local[seg_N]
    half_N = (cu_local[seg_N + 1] - start_N) // 2  # one chunk of the segment
    offset_N = token_N - start_N
    chunk_N = torch.where(offset_N < half_N, rank, 2 * world_size - 1 - rank)
    # The first half's chunk starts at rank * chunk, the second's at (2 * cp - 1 - rank) * chunk;
    # a token in the second half is already one chunk in: subtract it.
    index_N = start_N * world_size + chunk_N * half_N + offset_N - (offset_N >= half_N) * half_N
    return index_N.to(torch.int32)
