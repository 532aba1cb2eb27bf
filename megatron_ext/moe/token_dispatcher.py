"""Megatron token dispatchers that hand the experts fp8/mxfp8/nvfp4-aligned token groups.

Thin subclasses of Megatron-Core 0.19's ``MoEAlltoAllTokenDispatcher`` and
``MoEAllGatherTokenDispatcher``; the math is :mod:`megatron_ext.moe.alignment`. They align in
``dispatch_postprocess`` (after the all-to-all / all-gather, so no pad row is ever communicated)
and strip in ``combine_preprocess``; the experts receive aligned ``tokens_per_expert``.

- All-to-all: one scatter both sorts the received ``[source rank][local expert]`` chunks by expert
  (replacing Megatron's ``sort_chunks_by_idxs``, which reads split sizes on the host) and pads
  each group; one gather undoes both on the way back.
- All-gather: Megatron's permute already sorts by expert; the padding scatter follows it.
- Alignment 0 (bf16/fp16): every method defers to Megatron's, so outputs are bitwise identical.
- TP > 1 (all-to-all): Megatron's TP all-gather before and reduce-scatter after, around the
  aligned scatter/gather (tested at TP=2 x EP=2 against the stock dispatcher).

Example: 37 tokens, top-2, 8 experts on one rank, nvfp4 (128)::

    Megatron router padding: tokens_per_expert = [37]*8    (only real tokens to duplicate)
    this dispatcher:          tokens_per_expert = [128]*8   (zero rows, never sent anywhere)
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
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.config import MoEAlignmentConfig
from megatron_ext.moe import alignment as al


def align_size_for_config(config: TransformerConfig, alignment: MoEAlignmentConfig) -> int:
    """The group multiple for a Megatron config (0: no alignment).

    Follows Megatron's ``get_align_size_for_quantization`` for quantized GEMMs: fp8 16, mxfp8 32,
    fp4 128, and 256 under ``use_transformer_engine_op_fuser`` (CUTLASS grouped GEMM); a
    ``--moe-dispatch-align-size`` override wins (``check_megatron_args`` keeps it a multiple of
    Megatron's value). Without fp8/fp4 it is 0, unlike Megatron's function, which returns 256
    under the op fuser even for bf16: Megatron only *uses* that value when fp8/fp4 is on
    (``TEGroupedMLP`` builds and calls its ``Fp8Padding`` only then), and bf16 must stay
    Megatron's path, untouched.
    """
    if not alignment.moe_dispatch_align or not (config.fp8 or config.fp4):
        return 0
    if alignment.moe_dispatch_align_size is None and config.use_transformer_engine_op_fuser:
        return 256
    return alignment.align_size(
        fp8=config.fp8, fp8_recipe=config.fp8_recipe, fp4=config.fp4, fp4_recipe=config.fp4_recipe
    )


class _GroupAligner:
    """The alignment state one dispatcher carries between dispatch and combine.

    The multiple is read from the config at every dispatch (a few attribute reads), so it always
    matches the precision the experts' GEMMs run in.
    """

    def __init__(self, config: TransformerConfig, alignment: MoEAlignmentConfig) -> None:
        self.config = config
        self.alignment = alignment
        self.buffer_sizing = alignment.moe_dispatch_align_buffer
        self.layout: al.AlignedLayout | None = None

    @property
    def align(self) -> int:
        return align_size_for_config(self.config, self.alignment)

    @property
    def active(self) -> bool:
        return not al.is_identity(self.align)

    def pad(
        self,
        x_N: torch.Tensor,
        probs_N: torch.Tensor,
        counts_RE: torch.Tensor,
        host_tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pads received rows into the aligned layout.

        Args:
            x_N: Received hidden rows in ``[source chunk][expert]`` order.
            probs_N: Their routing probabilities.
            counts_RE: Device counts of those chunks, [R, E].
            host_tokens_per_expert_E: The counts Megatron already copied to the host (CPU).

        Returns:
            ``(x_P, host aligned tokens_per_expert_E, probs_P)``.
        """
        align = self.align
        aligned_host_E = al.round_up(host_tokens_per_expert_E.long(), align)
        if self.buffer_sizing == "host_counts":
            num_rows = _host_aligned_rows(host_tokens_per_expert_E, align)
        else:
            num_rows = al.static_aligned_rows(x_N.shape[0], counts_RE.shape[1], align)
            # The slack rows join the last group, as in the device layout (host tensor math).
            aligned_host_E[-1:] += num_rows - aligned_host_E.sum()
        self.layout = al.plan_aligned_layout(counts_RE, align, x_N.shape[0], num_rows)
        return (
            al.pad_to_layout(x_N, self.layout),
            aligned_host_E,
            al.pad_to_layout(probs_N, self.layout),
        )

    def strip(self, y_P: torch.Tensor) -> torch.Tensor:
        """Drops pad rows; rows come back in the order they were received."""
        assert self.layout is not None, "combine_preprocess without a matching dispatch"
        y_N = al.strip_layout(y_P, self.layout)
        self.layout = None
        return y_N


def _host_aligned_rows(host_tokens_per_expert_E: torch.Tensor, align: int) -> int:
    """Exact aligned buffer length from host-resident counts.

    NOTE: reads values of a CPU tensor that Megatron's dispatcher already copied to the host and
    synchronised (``_maybe_dtoh_and_synchronize``); on a GPU this is no device-to-host sync. The
    CPU sync detector still counts it as a value read; ``static_bound`` sizing avoids it.
    """
    return al.aligned_rows_from_host_counts(host_tokens_per_expert_E, align)


class AlignedAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """``MoEAlltoAllTokenDispatcher`` whose experts receive aligned token groups.

    Args:
        num_local_experts: Experts on this rank.
        local_expert_indices: Their global indices.
        config: Megatron's transformer config.
        pg_collection: Process groups (Megatron's default when None).
        alignment: megatron_ext's MoE config; the multiple follows ``config``'s precision (0 under
            bf16/fp16: Megatron's behaviour, untouched).
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config,
        pg_collection=None,
        *,
        alignment: MoEAlignmentConfig,
    ) -> None:
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
        if self.drop_and_pad and alignment.moe_dispatch_align:
            raise ValueError(
                "--moe-dispatch-align cannot be combined with --moe-pad-expert-input-to-capacity"
            )
        self.aligner = _GroupAligner(config, alignment)
        self._counts_RE: torch.Tensor | None = None

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Megatron's preprocess, keeping the device counts before they are copied to the host."""
        tokens_per_local_expert = super().preprocess(routing_map)
        if self.aligner.active:
            if self.num_local_experts > 1:
                # [tp*ep, local experts] in the order the chunks arrive; still on the device here.
                self._counts_RE = self.num_global_tokens_per_local_expert.view(
                    -1, self.num_local_experts
                )
            else:
                self._counts_RE = tokens_per_local_expert.view(1, 1)
        return tokens_per_local_expert

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        """TP all-gather as Megatron, then one scatter that sorts by expert and pads."""
        if not self.aligner.active or self._counts_RE is None:
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
        x_P, tokens_per_expert, probs_P = self.aligner.pad(
            global_input_tokens, global_probs, self._counts_RE, host_tokens_per_expert
        )
        self._counts_RE = None
        return x_P, tokens_per_expert, probs_P

    def combine_preprocess(self, hidden_states):
        """One gather strips the pads and restores the received order, then TP reduce-scatter."""
        if self.aligner.layout is None:
            return super().combine_preprocess(hidden_states)
        hidden_states = self.aligner.strip(hidden_states)
        if self.tp_size > 1:
            sizes = None if self.output_splits_tp is None else self.output_splits_tp.tolist()
            hidden_states = reduce_scatter_to_sequence_parallel_region(
                hidden_states.to(self.probs.dtype), group=self.tp_group, input_split_sizes=sizes
            ).to(hidden_states.dtype)
        return hidden_states


class AlignedAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """``MoEAllGatherTokenDispatcher`` whose experts receive aligned token groups.

    Megatron's router padding is refused for this dispatcher; this one aligns it anyway. Args as
    :class:`AlignedAlltoAllTokenDispatcher`.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config,
        pg_collection=None,
        *,
        alignment: MoEAlignmentConfig,
    ) -> None:
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
        self.aligner = _GroupAligner(config, alignment)

    def dispatch_postprocess(self, hidden_states, probs):
        """Megatron's permute by expert, then the padding scatter (one chunk per expert)."""
        x_N, host_tokens_per_expert, probs_N = super().dispatch_postprocess(hidden_states, probs)
        if not self.aligner.active:
            return x_N, host_tokens_per_expert, probs_N
        counts_1E = self.local_map.sum(dim=0).long().view(1, -1)  # device, like local_map
        return self.aligner.pad(x_N, probs_N, counts_1E, host_tokens_per_expert)

    def combine_preprocess(self, hidden_states):
        """Strips the pads, then Megatron's unpermute."""
        if self.aligner.layout is not None:
            hidden_states = self.aligner.strip(hidden_states)
        return super().combine_preprocess(hidden_states)
