"""A CPU stand-in for context-parallel attention, so Megatron's real loop trains CP > 1 on gloo ranks
(``--cpu`` only, never built on a GPU launch; docs/compat.md).

Megatron-Core 0.19.2 runs context parallelism only in Transformer Engine's attention; its local
``DotProductAttention`` asserts ``context_parallel_size == 1``. This one computes what TE's CP
attention computes, plainly: K and V all-gathered over the CP group, put in global order, and this
rank's queries attended at their global positions (:mod:`megatron_ext.cpu.document_attention`).
What it does not model is refused under ``--cpu`` (training/cpu_args.py; docs/limits.md). Example::

    spec = with_context_parallel_attention(get_gpt_layer_local_spec(num_experts=8))
"""

import copy
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_ext.common.spec_tree import swap_module
from megatron_ext.common.token_positions import cp_zigzag_positions
from megatron_ext.cpu.document_attention import (
    attend,
    causal_allowed,
    document_causal_allowed,
    global_order,
    segment_ids,
)


class ContextParallelDotProductAttention(DotProductAttention):
    """``DotProductAttention`` over the whole sequence of the CP group (``--cpu`` rehearsal)."""

    def __init__(self, config: Any, *args: Any, pg_collection: Any = None, **kwargs: Any) -> None:
        view = copy.copy(config)  # Megatron's setup, except the CP assertion this class exists for
        view.context_parallel_size = 1
        super().__init__(view, *args, pg_collection=pg_collection, **kwargs)
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp_group or parallel_state.get_context_parallel_group()
        if self.config.softmax_type != "vanilla" or self.scale_mask_softmax.window_size:
            raise ValueError(
                "the --cpu context-parallel attention models --softmax-type vanilla without "
                "--window-size only"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attention of this rank's queries; ``[t, hp]`` (THD) or ``[s, b, hp]``."""
        del attn_mask_type  # causal, as the GPT layer specs build it
        assert attention_bias is None, "Attention bias is not supported for DotProductAttention."
        cp_size = self.cp_group.size()
        # THD: query [t, np, hn]; sbhd: query [s, b, np, hn].
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:  # [t, np, hn] -> one sample
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        total = query.shape[0] * cp_size
        if thd:
            # Positions from TE's partition index, the function get_batch_on_this_cp_rank sliced
            # the batch with, over the packed params' GLOBAL cu_seqlens; causal per segment.
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            positions_RN = torch.stack([_thd_index(cu, total, cp_size, r) for r in range(cp_size)])
            allowed_QK = document_causal_allowed(
                positions_RN[self.cp_group.rank()], segment_ids(cu, total)
            )
        else:
            # Megatron's per-sequence zigzag.
            positions_RN = torch.stack(
                [cp_zigzag_positions(total, cp_size, r) for r in range(cp_size)]
            ).to(query.device)
            allowed_QK = causal_allowed(positions_RN[self.cp_group.rank()], total)
        allowed_BQK = allowed_QK.unsqueeze(0)
        # The batch's own mask, [b, 1, s_local, S] (True = masked): get_batch_on_this_cp_rank slices
        # its query dimension only, so its keys are already global.
        if attention_mask is not None and not thd:
            allowed_BQK = ~attention_mask[:, 0].to(torch.bool)
        # Megatron's differentiable collective over the CP group: forward all-gather, backward
        # reduce-scatter, so each rank's K/V gradients come back to it.
        key, value = (
            global_order(
                tensor_parallel.gather_from_sequence_parallel_region(t, group=self.cp_group),
                positions_RN,
            )
            for t in (key, value)
        )
        out_BQHD = attend(
            query.transpose(0, 1),
            key.transpose(0, 1),
            value.transpose(0, 1),
            allowed_BQK,
            self.softmax_scale * (self.scale_mask_softmax.scale or 1.0),
            dropout=self._dropout,
        )
        out = out_BQHD.transpose(0, 1).reshape(*out_BQHD.shape[1::-1], -1)  # [s, b, hp]
        return out[:, 0] if thd else out

    def _dropout(self, probs: torch.Tensor) -> torch.Tensor:
        """Megatron's attention dropout, in the same RNG-tracker fork as its local attention."""
        if self.config.sequence_parallel:
            return self.attention_dropout(probs)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.attention_dropout(probs)


def _thd_index(cu_seqlens: torch.Tensor, total: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The positions CP rank ``cp_rank`` holds, as ``get_batch_on_this_cp_rank`` sliced them."""
    # Looked up per call: under --cpu, ``utils.tex`` is the compat row cpu.te_partition's stand-in
    # (megatron_ext.common.thd_partition).
    from megatron.core import utils

    return utils.tex.thd_get_partitioned_indices(cu_seqlens, total, cp_size, cp_rank).long()


def with_context_parallel_attention(node: Any) -> Any:
    """``node`` (a layer, block or stack spec) with every ``DotProductAttention`` replaced by
    :class:`ContextParallelDotProductAttention`."""
    return swap_module(node, DotProductAttention, ContextParallelDotProductAttention)
