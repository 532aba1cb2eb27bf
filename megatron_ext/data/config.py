"""Flags of the data feature (self-token padding, document packing): :class:`PaddingConfig`."""

import argparse
import warnings
from dataclasses import dataclass, field
from typing import Literal

from megatron_ext.config.megatron_view import MegatronView
from megatron_ext.config.registry import feature_config, flag
from megatron_ext.data.pack_planning import OverlongPolicy, PackingAlgorithm
from megatron_ext.data.padding import PadPolicy, derive_pad_multiple


@feature_config("data: self-token padding and document packing")
@dataclass(frozen=True, kw_only=True)
class PaddingConfig:
    """How packs are padded and how documents are packed (megatron_ext.data)."""

    pad_policy: PadPolicy = "self"
    """Pad content: 'self' repeats the pack's own tokens (pads route like real text, no MoE hot
    spot); 'constant' writes --pad-constant-id. Pads are always loss-masked and after every real
    token."""

    pad_constant_id: int = 0
    """Token id of constant pads (--pad-policy constant, multimodal packs, empty packs)."""

    pad_to_seq_len: bool = False
    """Pad every pack to exactly --seq-length (static shapes: no recompiles)."""

    pad_to_multiple_of: int | None = None
    """Pad packs to a multiple of this; default derived from the run: 2*CP with context
    parallelism, TP with sequence parallelism, Megatron's fp8/fp4 GEMM alignment (fp8 16, mxfp8
    32, nvfp4 128) (their lcm)."""

    pack_documents: bool = False
    """Train on megatron_ext's PackedDataset (whole documents packed, document boundaries kept)
    instead of the self-padded GPTDataset."""

    packing_algorithm: PackingAlgorithm = "best_fit"
    """'sequential' keeps the shuffled order (next-fit); 'best_fit' packs longest-first into the
    tightest pack within --packing-window documents (fewer pads)."""

    packing_window: int = 1000
    """Documents considered together by --packing-algorithm best_fit."""

    pack_overlong_policy: OverlongPolicy = "split"
    """Documents longer than --seq-length: split into pieces, keep the head, or drop them."""

    pack_loss_mask_suffix: str | None = None
    """If set, every --data-path prefix P has a per-token loss-mask sidecar IndexedDataset at
    P + suffix (1 = train on this token, 0 = prompt), e.g. '_loss_mask'."""

    sft_packing: Literal["packed", "megatron"] = "packed"
    """With Megatron's --sft: 'packed' packs whole conversations across JSONL lines
    (--packing-algorithm; --pack-overlong-policy split loses no token); 'megatron' keeps Megatron's
    SFTDataset rule (one line per sample, the conversation that overflows cut, the rest of the
    line dropped). Pads follow --pad-policy either way."""

    multimodal_placeholder_ids: list[int] = field(default_factory=list)
    """Placeholder token ids (e.g. image tokens); a pack containing one pads with
    --pad-constant-id so a placeholder never leaves its item."""

    def __post_init__(self) -> None:
        if self.pad_policy not in ("self", "constant"):
            raise ValueError(f"--pad-policy must be 'self' or 'constant', got {self.pad_policy!r}")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"--pad-to-multiple-of must be >= 1, got {self.pad_to_multiple_of}")
        if self.packing_algorithm not in ("sequential", "best_fit"):
            raise ValueError(
                "--packing-algorithm must be 'sequential' or 'best_fit', "
                f"got {self.packing_algorithm!r}"
            )
        if self.packing_window < 1:
            raise ValueError(f"--packing-window must be >= 1, got {self.packing_window}")
        if self.pack_overlong_policy not in ("split", "truncate", "drop"):
            raise ValueError(
                "--pack-overlong-policy must be 'split', 'truncate' or 'drop', "
                f"got {self.pack_overlong_policy!r}"
            )
        if self.pad_constant_id < 0:
            raise ValueError(f"--pad-constant-id must be >= 0, got {self.pad_constant_id}")
        # A pack holding a placeholder pads with the constant id: it must not be one itself.
        if self.pad_constant_id in self.multimodal_placeholder_ids:
            raise ValueError(
                f"--pad-constant-id {self.pad_constant_id} is one of "
                "--multimodal-placeholder-ids: pads would look like image tokens"
            )
        if self.sft_packing not in ("packed", "megatron"):
            raise ValueError(
                f"--sft-packing must be 'packed' or 'megatron', got {self.sft_packing!r}"
            )
        if self.pack_loss_mask_suffix == "":
            raise ValueError("--pack-loss-mask-suffix must not be empty")

    def pad_multiple(
        self,
        *,
        context_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        sequence_parallel: bool = False,
        quantization_align: int = 1,
    ) -> int:
        """The pack-length multiple for this run: the user's value, else the derived one.

        ``quantization_align``: Megatron's fp8/fp4 GEMM row alignment (1 in bf16).

        Raises:
            ValueError: The user's --pad-to-multiple-of is not a multiple of what the run needs.
        """
        required = derive_pad_multiple(
            context_parallel_size=context_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            sequence_parallel=sequence_parallel,
            quantization_align=quantization_align,
        )
        if self.pad_to_multiple_of is None:
            return required
        if self.pad_to_multiple_of % required:  # refused, not overridden: name what needs more
            why = []
            if context_parallel_size > 1:
                why.append(f"--context-parallel-size {context_parallel_size} (needs 2*CP)")
            if sequence_parallel and tensor_parallel_size > 1:
                why.append(
                    f"--sequence-parallel with --tensor-model-parallel-size {tensor_parallel_size}"
                )
            if quantization_align > 1:
                why.append(f"--fp8-format/--fp4-format (the recipe needs {quantization_align})")
            raise ValueError(
                f"--pad-to-multiple-of {self.pad_to_multiple_of} conflicts with "
                f"{', '.join(why)}: it must be a multiple of {required}"
            )
        return self.pad_to_multiple_of

    @staticmethod
    def doc_pad_multiple(context_parallel_size: int = 1) -> int:
        """Every packed document's length multiple: 2*CP under context parallelism, else 1."""
        # TE's THD partitioning cuts each document into 2*CP equal chunks, one pair per CP rank.
        return 2 * context_parallel_size if context_parallel_size > 1 else 1

    def check_megatron_args(self, args: argparse.Namespace) -> None:
        """Checks the padding multiple against Megatron's CP / TP+SP / fp8/fp4 and --seq-length."""
        from megatron_ext.data.quantization_align import quantization_align_from_args

        view = MegatronView.from_args(args)
        multiple = self.pad_multiple(
            context_parallel_size=view.context_parallel_size or 1,
            tensor_parallel_size=view.tensor_model_parallel_size or 1,
            sequence_parallel=bool(view.sequence_parallel),
            quantization_align=quantization_align_from_args(args),
        )
        self._warn_unused(view)
        self._check_data(args, view)
        # A full pack is --seq-length long: it must itself be a multiple, or pad past it.
        seq_length = view.seq_length
        if seq_length is not None and seq_length % multiple:
            raise ValueError(
                f"--seq-length {seq_length} is not a multiple of the pack-length multiple "
                f"{multiple} (--pad-to-multiple-of / derived from CP, TP+SP, fp8/fp4)"
            )

    def _warn_unused(self, view: MegatronView) -> None:
        """Warns about the flags set to no effect on this run's dataset."""
        packs = ("packing_algorithm", "packing_window", "pack_overlong_policy")
        packs_only = ("pack_loss_mask_suffix", "pad_to_seq_len", "pad_to_multiple_of")
        if view.sft:  # SFT samples are always --seq-length long; constant pads the tokenizer's
            names, why = (*packs_only, "pad_constant_id"), "with --sft"
            if self.sft_packing == "megatron":
                names, why = (*names, *packs), "with --sft --sft-packing megatron"
        elif not self.pack_documents:
            names, why = (*packs, *packs_only, "sft_packing"), "without --pack-documents"
        else:
            names, why = ("sft_packing",), "without --sft"
        unused = [
            flag(name)
            for name in names
            if getattr(self, name) != PaddingConfig.__dataclass_fields__[name].default
        ]
        if unused:
            warnings.warn(f"{unused} have no effect {why}", stacklevel=3)

    def _check_data(self, args: argparse.Namespace, view: MegatronView) -> None:
        """Data files, blend weights and the pad id, checked at argument time (so by --dry-run)."""
        from megatron_ext.data.data_args import check_data_args

        check_data_args(
            args, self.pack_loss_mask_suffix if self.pack_documents else None, jsonl=view.sft
        )
        # Megatron's padded vocabulary when known (the embedding's rows), else the tokenizer's.
        vocab = view.padded_vocab_size or view.vocab_size
        if isinstance(vocab, int) and self.pad_constant_id >= vocab:
            raise ValueError(
                f"--pad-constant-id {self.pad_constant_id} is outside the vocabulary (size {vocab})"
            )
