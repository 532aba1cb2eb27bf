"""Megatron token dispatchers that hand the experts fp8/mxfp8/nvfp4-aligned token groups.

Thin subclasses of Megatron-Core 0.19's ``MoEAlltoAllTokenDispatcher`` and
``MoEAllGatherTokenDispatcher``; the math is :mod:`megatron_ext.moe.alignment` and
:mod:`megatron_ext.moe.aligned_permute`. The pad is in the *index*, not an extra copy of the data,
and no pad row is ever communicated:

- All-gather, and all-to-all at EP=1 (TP=1): the padded layout is folded into Megatron's permute
  (one gather builds the aligned buffer, pad rows zeroed) and the strip into its unpermute (one
  scatter-add, pads onto a dropped trash row). Megatron's identity chunk sort at EP=1 disappears.
- All-to-all, EP > 1 or TP > 1: the pad goes into Megatron's chunk sort after the exchange: the
  same split + ``cat`` of the received ``[source rank][local expert]`` chunks by expert, from the
  chunk counts Megatron already copied to the host for it, with slices of one reused zero buffer
  spliced in as each group's pad; the un-sort in ``combine_preprocess`` drops them. (Under TE's
  fused permute the counts stay on the device: one gather through an inverse index sorts and
  pads instead, planned on the device, sync-free.) Megatron's TP all-gather / reduce-scatter
  around it.
- Alignment 0 (bf16/fp16): every method defers to Megatron's, so outputs are bitwise identical.

Example: 37 tokens, top-2, 8 experts on one rank, nvfp4 (128)::

    Megatron router padding: tokens_per_expert = [37]*8    (only real tokens to duplicate)
    this dispatcher:          tokens_per_expert = [128]*8   (zero rows, never sent anywhere)
"""

import itertools

import numpy as np
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
from megatron_ext.moe import aligned_chunk_sort as cs
from megatron_ext.moe import aligned_permute as ap
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
    matches the precision the experts' GEMMs run in. ``pad`` and ``strip`` are the only entry
    points that touch rows (tools/gpu/gpu_check.py guards exactly these two). The zero rows the
    chunk sort splices in are slices of :func:`~megatron_ext.moe.alignment.shared_zero_rows`.
    """

    def __init__(self, config: TransformerConfig, alignment: MoEAlignmentConfig) -> None:
        self.config = config
        self.alignment = alignment
        self.buffer_sizing = alignment.moe_dispatch_align_buffer
        self.layout: al.AlignedLayout | cs.ChunkLayout | ap.PermuteLayout | None = None
        self._aligns: dict[tuple, int] = {}

    @property
    def align(self) -> int:
        """The multiple for the config's precision now (memoised per precision setting)."""
        c = self.config
        key = (c.fp8, c.fp8_recipe, c.fp4, c.fp4_recipe, c.use_transformer_engine_op_fuser)
        align = self._aligns.get(key)
        if align is None:
            align = self._aligns[key] = align_size_for_config(c, self.alignment)
        return align

    @property
    def active(self) -> bool:
        return not al.is_identity(self.align)

    @property
    def fused(self) -> bool:
        """True while a permute-folded layout is pending (its strip is the unpermute)."""
        return isinstance(self.layout, ap.PermuteLayout)

    def pad(
        self,
        x: torch.Tensor,
        probs: torch.Tensor,
        routing: torch.Tensor | list[list[int]],
        host_tokens_per_expert_E: torch.Tensor | None,
        num_out_tokens: int | None = None,
        rank_TE: torch.Tensor | None = None,
        align: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Builds the aligned buffer with one copy of the rows.

        Three layouts, told apart by ``routing``:

        - a bool routing map ``[T, E]``: ``x`` are the tokens ``[T, D]`` and ``probs`` their
          ``[T, E]`` probabilities; Megatron's permute and the pad in one gather.
        - host counts ``[R][E]`` (Python ints): ``x``/``probs`` are rows received in ``[source
          chunk][expert]`` order; Megatron's chunk sort (one ``cat``) with the pads spliced in.
        - device counts ``[R, E]``: the same rows; one gather through an inverse index sorts
          and pads (when the counts never reached the host: Megatron's fused-permute path).

        Args:
            x: Rows to lay out (see above).
            probs: Their routing probabilities.
            routing: The local routing map, or the received chunks' counts.
            host_tokens_per_expert_E: The per-expert counts Megatron already copied to the host
                (permute only), or None where they have not arrived yet (all-to-all at EP=1:
                a static-bound buffer, cut to the exact length by ``exact_host_sizes``).
            num_out_tokens: Rows the permute emits (Megatron's ``num_out_tokens``); permute
                without host counts only.
            rank_TE: The routing map's ``rank_within_expert`` when the caller took its counts
                from it (permute only).
            align: :attr:`align` when the caller has just read it (saves reading it again).

        Returns:
            ``(x_P, aligned tokens_per_expert_E, probs_P)``; the counts are a host tensor, or
            None for a permute without host counts (its caller gets them from
            ``exact_host_sizes`` once Megatron's host counts arrive).
        """
        align = align or self.align
        if isinstance(routing, list):
            layout = cs.plan_chunk_layout(
                routing, align, self._static_rows(x.shape[0], routing, align)
            )
            self.layout = layout
            x_P = cs.pad_chunks(x, layout, al.shared_zero_rows(x, layout.max_pad))
            probs_P = cs.pad_chunks(probs, layout, al.shared_zero_rows(probs, layout.max_pad))
            return x_P, torch.tensor(layout.tokens_per_expert_E), probs_P
        num_experts = routing.shape[1]
        if routing.dtype != torch.bool:  # device chunk counts
            num_rows = self._static_rows(x.shape[0], routing, align)
            if num_rows is None:
                num_rows = _host_rows(host_tokens_per_expert_E, align)[1]
            layout = al.plan_aligned_layout(routing, align, x.shape[0], num_rows)
            self.layout = layout
            aligned_E = al.give_slack_to_last(
                al.round_up(host_tokens_per_expert_E.long(), align), num_rows
            )
            return al.pad_to_layout(x, layout), aligned_E, al.pad_to_layout(probs, layout)
        if host_tokens_per_expert_E is None:  # static bound now, the sizes with exact_host_sizes
            num_rows = al.static_aligned_rows(num_out_tokens, num_experts, align)
            layout = ap.plan_aligned_permute(
                routing, align, num_out_tokens, num_rows, rank_TE=rank_TE
            )
            aligned_E = None
        else:  # the groups' starts are known on the host: the plan skips computing them
            num_real, num_rows, aligned_E, start_E, host_sizes = self._host_sizes(
                host_tokens_per_expert_E, align
            )
            layout = ap.plan_aligned_permute(
                routing,
                align,
                num_real,
                num_rows,
                exact=self.buffer_sizing == "host_counts",
                start_E=al.host_to_device(start_E, routing),
                rank_TE=rank_TE,
                host_sizes=host_sizes,
            )
        self.layout = layout
        return ap.permute_to_layout(x, layout), aligned_E, ap.permute_probs(probs, layout)

    def _static_rows(
        self, num_received: int, counts: torch.Tensor | list, align: int
    ) -> int | None:
        """The static bound for ``static_bound`` sizing; None for exact (host counts) sizing."""
        if self.buffer_sizing == "host_counts":
            return None
        return al.static_aligned_rows(num_received, len(counts[0]), align)

    def _host_sizes(
        self, host_tokens_per_expert_E: torch.Tensor, align: int
    ) -> tuple[int, int, torch.Tensor, torch.Tensor, tuple[list[int], list[int]]]:
        """``(real rows N, buffer rows P, aligned host counts, host group starts, (counts,
        aligned sizes) as Python ints)`` from host counts, one read."""
        counts = _host_counts(host_tokens_per_expert_E)
        aligned = al.round_up_host(counts, align)
        num_real, num_rows = sum(counts), sum(aligned)
        if self.buffer_sizing != "host_counts":
            # The slack rows join the last group, as in the device layout.
            static_rows = al.static_aligned_rows(num_real, len(counts), align)
            aligned[-1] += static_rows - num_rows
            num_rows = static_rows
        # One host array, cut by numpy: torch's own indexing would add two dispatched ops.
        sizes = np.array([*aligned, *itertools.accumulate(aligned[:-1], initial=0)], np.int64)
        num_experts = len(aligned)
        aligned_E = torch.from_numpy(sizes[:num_experts])
        start_E = torch.from_numpy(sizes[num_experts:])
        return num_real, num_rows, aligned_E, start_E, (counts, aligned)

    def exact_host_sizes(
        self, x_P: torch.Tensor, probs_P: torch.Tensor, host_tokens_per_expert_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sizes a static-bound permute once Megatron's host counts have arrived.

        ``host_counts`` sizing cuts the buffer to the exact aligned length (a prefix: views, no
        copy); ``static_bound`` keeps it. Returns ``(x_P, host aligned counts, probs_P)``.
        """
        assert self.fused, "exact_host_sizes follows a permute-folded pad"
        if self.buffer_sizing != "host_counts":
            aligned_E = al.round_up(host_tokens_per_expert_E.long(), self.align)
            return x_P, al.give_slack_to_last(aligned_E, self.layout.num_rows), probs_P
        num_real, num_rows, aligned_E, _, host_sizes = self._host_sizes(
            host_tokens_per_expert_E, self.align
        )
        # Host ints, free: the rows laid out are the rows Megatron counted (a caller that routes
        # a token nowhere must lower num_out_tokens to match, as Megatron's permute requires).
        assert num_real == self.layout.num_rows - self.layout.num_pads, num_real
        self.layout = self.layout.narrow(num_rows, host_sizes)
        return x_P[:num_rows], aligned_E, probs_P[:num_rows]

    def strip(self, y_P: torch.Tensor) -> torch.Tensor:
        """Drops pad rows: back in received order, or (permute-folded) unpermuted to tokens."""
        layout, self.layout = self.layout, None
        assert layout is not None, "combine without a matching dispatch"
        if isinstance(layout, ap.PermuteLayout):
            return ap.unpermute_from_layout(y_P, layout)
        if isinstance(layout, cs.ChunkLayout):
            return cs.strip_chunks(y_P, layout)
        return al.strip_layout(y_P, layout)


def _host_counts(host_counts: torch.Tensor) -> list:
    """The values of counts Megatron already holds on the host, in one read.

    NOTE: reads a CPU tensor that Megatron's dispatcher already copied to the host and
    synchronised (``_maybe_dtoh_and_synchronize``, or the all-gather dispatcher's ``.cpu()``); on
    a GPU this is no device-to-host sync. The CPU sync detector still counts it as a value read.
    """
    assert host_counts.is_cpu, "host counts must already be on the host"
    return host_counts.tolist()


def _host_rows(host_tokens_per_expert_E: torch.Tensor, align: int) -> tuple[int, int]:
    """``(rows, exact aligned rows)`` from host-resident counts, in one read (see above)."""
    return al.real_and_aligned_rows_from_host_counts(host_tokens_per_expert_E, align)


class AlignedAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """``MoEAlltoAllTokenDispatcher`` whose experts receive aligned token groups.

    At EP=1 and TP=1 the pad is folded into Megatron's permute (``dispatch_preprocess``) and the
    strip into its unpermute (``combine_postprocess``); otherwise the pad goes into the chunk sort
    after the all-to-all. Either way the all-to-all carries exactly the unaligned rows.

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
        if not self._folds_into_permute():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        # Megatron's steps, in its order, with the permute replaced (no router padding here).
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
        if self.num_local_experts == 1:  # one group: nothing to sort, pads at the end
            chunks = [[global_input_tokens.shape[0]]]
        elif self.num_global_tokens_per_local_expert.device.type == "cpu":
            # Megatron copied the chunk counts to the host for its own chunk sort.
            chunks = _host_counts(self.num_global_tokens_per_local_expert)
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
            output += self.shared_experts.get_output()
        return output


def _host_int(n: int | torch.Tensor) -> int:
    """Megatron's ``num_out_tokens``: a host int when dropless (N*topk, or a caller's lowered
    count); a CPU tensor already copied by ``_maybe_dtoh_and_synchronize`` under token dropping."""
    return n if isinstance(n, int) else int(n)


class AlignedAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """``MoEAllGatherTokenDispatcher`` whose experts receive aligned token groups.

    The pad is folded into Megatron's permute and the strip into its unpermute. Megatron's router
    padding is refused for this dispatcher; this one aligns it anyway. Args as
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
        """Megatron's permute by local expert, writing the aligned buffer directly."""
        align = self.aligner.align
        if al.is_identity(align):
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
            align=align,
        )
        self.local_probs = probs_P
        self.routing_map = None
        return x_P, tokens_per_expert, probs_P

    def combine_preprocess(self, hidden_states):
        """The unpermute, stripping the pads in the same scatter-add."""
        if self.aligner.layout is None:
            return super().combine_preprocess(hidden_states)
        return self.aligner.strip(hidden_states)  # in the rows' own dtype, as Megatron's
