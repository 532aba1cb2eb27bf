"""Megatron token dispatchers that hand the experts fp8/mxfp8/nvfp4-aligned token groups.

Thin subclasses of Megatron-Core 0.19's all-to-all and all-gather dispatchers, each owning a
:class:`~megatron_ext.moe.group_aligner.GroupAligner`: the pad is in the *index*, never an extra
copy of the data nor a communicated row; under bf16/fp16 every method is Megatron's. 37 tokens,
top-2, 8 experts on one rank, nvfp4: Megatron's router padding gives ``[37]*8`` (unaligned: only
real tokens to duplicate), this dispatcher ``[128]*8``.
"""

import torch
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)

from megatron_ext.moe import aligned_permute as ap
from megatron_ext.moe.config import MoEAlignmentConfig
from megatron_ext.moe.group_aligner import GroupAligner, read_host_counts


class AlignedAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """``MoEAlltoAllTokenDispatcher`` whose experts receive aligned token groups (``align``, the
    multiple the MoE layer decided; 0 under bf16/fp16: Megatron's behaviour, untouched); the
    all-to-all carries exactly the unaligned rows."""

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config,
        pg_collection=None,
        *,
        alignment: MoEAlignmentConfig,
        align: int,
    ) -> None:
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
        if self.drop_and_pad and alignment.moe_dispatch_align:
            raise ValueError(
                "--moe-dispatch-align cannot be combined with --moe-pad-expert-input-to-capacity"
            )
        self.aligner = GroupAligner(align, alignment.moe_dispatch_align_buffer)

    def _folds_into_permute(self) -> bool:
        """EP=1 and TP=1: no exchange between the permute and the experts (it is the identity)."""
        return (
            self.aligner.active
            and self.ep_size == 1
            and self.tp_size == 1
            and not self.config.moe_router_padding_for_quantization
        )

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """Megatron's dispatch_preprocess; at EP=1 its permute writes the aligned buffer."""
        # At EP=1 (TP=1) the pad folds into the permute and the strip into the unpermute (one
        # scatter-add, pads onto a dropped trash row): Megatron's identity chunk sort disappears.
        if not self._folds_into_permute():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        # Megatron's steps, in its order, with the permute replaced (no router padding here);
        # the upstream source is fingerprinted in megatron_ext/compat/table.py (group copied).
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        assert probs.dim() == 2 and routing_map.dim() == 2 and routing_map.dtype == torch.bool
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(self.routing_map)  # may be a subclass's
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
            "before_permutation_1", self.tokens_per_expert
        )
        self.hidden_shape_before_permute = hidden_states.shape
        # Host counts arrive only at Megatron's later sync point: size by the static bound of
        # num_out_tokens now, cut to the exact length in dispatch_postprocess.
        x_P, _, probs_P = self.aligner.pad(
            hidden_states, probs, self.routing_map, None, _host_int(self.num_out_tokens)
        )
        self.reversed_local_input_permutation_mapping = self.aligner.layout.token_idx_P
        return x_P, probs_P

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        """TP all-gather as Megatron, then its chunk sort with the pads in it (one copy)."""
        if not self.aligner.active:
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        if self.tp_size > 1:
            sizes = None if self.output_splits_tp is None else self.output_splits_tp.tolist()
            global_input_tokens = gather_from_sequence_parallel_region(
                global_input_tokens, group=self.tp_group, output_split_sizes=sizes
            )
            global_probs = gather_from_sequence_parallel_region(
                global_probs, group=self.tp_group, output_split_sizes=sizes
            )
        # Megatron's own copy-to-host points, unchanged: alignment adds none.
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
            "before_permutation_2", self.tokens_per_expert
        )
        host_tokens_per_expert = self._maybe_dtoh_and_synchronize(
            "before_finish", self.tokens_per_expert
        )
        self.tokens_per_expert = None
        if self.aligner.fused:  # EP=1: padded by the permute already
            return self.aligner.exact_host_sizes(
                global_input_tokens, global_probs, host_tokens_per_expert
            )
        # EP > 1 or TP > 1: Megatron's chunk sort (split + cat of the received [source rank][local
        # expert] chunks by expert) with slices of one reused zero buffer spliced in as pads;
        # combine_preprocess's un-sort drops them.
        if self.num_local_experts == 1:  # one group: nothing to sort, pads at the end
            chunks = [[global_input_tokens.shape[0]]]
        elif self.num_global_tokens_per_local_expert.device.type == "cpu":
            # Megatron copied the chunk counts to the host for its own chunk sort.
            chunks = read_host_counts(self.num_global_tokens_per_local_expert)
        else:  # fused permute: the counts stay on the device; plan there, sync-free
            chunks = self.num_global_tokens_per_local_expert.view(-1, self.num_local_experts)
        return self.aligner.pad(global_input_tokens, global_probs, chunks, host_tokens_per_expert)

    def combine_preprocess(self, hidden_states):
        """Megatron's chunk un-sort without the pad pieces (the permute strips at EP=1), then TP
        reduce-scatter."""
        if self.aligner.layout is None:
            return super().combine_preprocess(hidden_states)
        if self.aligner.fused:
            return hidden_states  # stripped by the unpermute in combine_postprocess
        hidden_states = self.aligner.strip(hidden_states)
        if self.tp_size > 1:
            sizes = None if self.output_splits_tp is None else self.output_splits_tp.tolist()
            hidden_states = reduce_scatter_to_sequence_parallel_region(
                hidden_states.to(self.probs.dtype), group=self.tp_group, input_split_sizes=sizes
            ).to(hidden_states.dtype)
        return hidden_states

    def combine_postprocess(self, permutated_local_input_tokens):
        """Megatron's unpermute; when the pad was folded into the permute it strips too."""
        if not self.aligner.fused:
            return super().combine_postprocess(permutated_local_input_tokens)
        output = self.aligner.strip(permutated_local_input_tokens)
        output = output.view(self.hidden_shape)  # the unpermute adds in the rows' own dtype
        if self.shared_experts is not None:
            # Out of place: the strip's output is a view its own autograd Function returns (the
            # [T, D] rows of a [T + 1, D] buffer), which autograd forbids modifying in place.
            output = output + self.shared_experts.get_output()
        return output


def _host_int(n: int | torch.Tensor) -> int:
    """Megatron's ``num_out_tokens``: a host int when dropless (N*topk, or a caller's lowered
    count); a CPU tensor already copied by ``_maybe_dtoh_and_synchronize`` under token dropping."""
    return n if isinstance(n, int) else int(n)


class AlignedAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """``MoEAllGatherTokenDispatcher`` whose experts receive aligned token groups (Megatron's
    router padding is refused for this dispatcher; this one aligns anyway). Args as
    :class:`AlignedAlltoAllTokenDispatcher`."""

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config,
        pg_collection=None,
        *,
        alignment: MoEAlignmentConfig,
        align: int,
    ) -> None:
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
        self.aligner = GroupAligner(align, alignment.moe_dispatch_align_buffer)

    def dispatch_postprocess(self, hidden_states, probs):
        """Megatron's permute by local expert, writing the aligned buffer directly (the strip is
        folded into its unpermute)."""
        if not self.aligner.active:
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        if self.num_local_experts == self.routing_map.shape[1]:  # every expert is local (EP=1)
            self.local_map, local_probs = self.routing_map, probs  # no slicing op to pay
        else:
            experts = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)
            self.local_map = self.routing_map[:, experts].contiguous()
            local_probs = probs[:, experts]
        # The plan's ranks end in Megatron's per-expert counts (its local_map.sum(dim=0)).
        rank_TE = ap.rank_within_expert(self.local_map)
        # NOTE: device-to-host sync, Megatron's own (its dispatch_postprocess makes the same copy).
        tokens_per_expert = ap.counts_from_ranks(rank_TE).cpu()
        x_P, tokens_per_expert, probs_P = self.aligner.pad(
            hidden_states,
            local_probs,
            self.local_map,
            tokens_per_expert,
            rank_TE=rank_TE,
        )
        self.local_probs = probs_P
        self.routing_map = None
        return x_P, tokens_per_expert, probs_P

    def combine_preprocess(self, hidden_states):
        """The unpermute, stripping the pads in the same scatter-add."""
        if self.aligner.layout is None:
            return super().combine_preprocess(hidden_states)
        return self.aligner.strip(hidden_states)  # in the rows' own dtype, as Megatron's
