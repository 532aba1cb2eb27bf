"""The math of the CPU context-parallel attention (pure torch, never imports megatron): one rank's
queries attend to the keys of the whole sequence, causally and within their document.

A query at global position p may attend to key k when ``k <= p`` and, in a packed row, k lies in
p's segment of ``cu_seqlens``: what Megatron's local ``DotProductAttention`` computes on one rank
with a causal (per-document) mask.

Worked example: ``cu_seqlens = [0, 4, 8]``, CP = 2, rank 1 holds positions ``[1 2 5 6]``. Its query
at position 5 (document 1) may attend to keys ``[4 5]``; at position 2, to ``[0 1 2]``.
"""

from collections.abc import Callable

import torch

# Shape suffix legend
#   B = samples, Q = this rank's queries, K = keys (the whole sequence), H = query heads,
#   G = key/value groups (GQA: H = G * heads per group), D = head dim, R = CP ranks,
#   N = positions per rank

#: Megatron's ``attention_mask_func`` fill for masked scores (megatron/core/transformer/utils.py).
MASKED_SCORE = -10000.0


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``seg_K``: the segment of ``cu_seqlens`` (1-D, ending at ``total``) holding each position."""
    positions = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64).contiguous(), positions, right=True)


def document_causal_allowed(q_pos_Q: torch.Tensor, seg_K: torch.Tensor) -> torch.Tensor:
    """``allowed_QK`` (True = may attend): a key at or before the query, in the query's segment."""
    key_K = torch.arange(seg_K.numel(), device=seg_K.device)
    same_doc = seg_K.unsqueeze(0) == seg_K[q_pos_Q].unsqueeze(1)
    return same_doc & (key_K.unsqueeze(0) <= q_pos_Q.unsqueeze(1))


def causal_allowed(q_pos_Q: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``allowed_QK``: a key at or before the query's global position."""
    key_K = torch.arange(num_keys, device=q_pos_Q.device)
    return key_K.unsqueeze(0) <= q_pos_Q.unsqueeze(1)


def global_order(rows_RN: torch.Tensor, positions_RN: torch.Tensor) -> torch.Tensor:
    """Rows gathered rank after rank (``[R * N, ...]``) put in global position order."""
    # By a gather, so the gradient flows back to each rank's rows.
    inverse = torch.argsort(positions_RN.reshape(-1).to(torch.int64))
    return rows_RN.index_select(0, inverse.to(rows_RN.device))


def attend(
    q_BQHD: torch.Tensor,
    k_BKGD: torch.Tensor,
    v_BKGD: torch.Tensor,
    allowed_BQK: torch.Tensor,
    scale: float,
    dropout: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of the queries over the keys where ``allowed``: ``out_BQHD``.

    GQA as Megatron's local attention: each key/value group repeated for its query heads.
    """
    heads, groups = q_BQHD.shape[2], k_BKGD.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} query heads do not split into {groups} key/value groups")
    if heads != groups:
        k_BKGD = k_BKGD.repeat_interleave(heads // groups, dim=2)
        v_BKGD = v_BKGD.repeat_interleave(heads // groups, dim=2)
    # fp32 softmax, as Megatron's local softmax under ``attention_softmax_in_fp32`` (and for fp32
    # inputs); the probabilities go back to the values' dtype before dropout, as there.
    scores_BHQK = torch.einsum("bqhd,bkhd->bhqk", q_BQHD, k_BKGD).float() * scale
    scores_BHQK = scores_BHQK.masked_fill(~allowed_BQK.unsqueeze(1), MASKED_SCORE)
    probs_BHQK = torch.softmax(scores_BHQK, dim=-1).to(v_BKGD.dtype)
    if dropout is not None:
        probs_BHQK = dropout(probs_BHQK)
    return torch.einsum("bhqk,bkhd->bqhd", probs_BHQK, v_BKGD)
