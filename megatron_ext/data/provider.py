"""The one place that maps a run's ``PaddingConfig`` to a Megatron dataset class and its config.

The pair goes straight to Megatron's builder::

    padding = configs_from_args(args)[PaddingConfig]
    multiple = padding.pad_multiple(context_parallel_size=cp, quantization_align=align)
    cls, config = dataset_class_and_config(padding, pad_multiple=multiple, **gpt_kwargs)
    train, valid, test = BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()
"""

from typing import Any

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

from megatron_ext.data.config import PaddingConfig
from megatron_ext.data.gpt_dataset import SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig
from megatron_ext.data.packed_dataset import PackedDataset, PackedDatasetConfig, Sidecar
from megatron_ext.data.pad_fill import PadFillFields


def dataset_class_and_config(
    padding: PaddingConfig,
    *,
    pad_multiple: int,
    doc_pad_multiple: int = 1,
    sidecars: dict[str, Sidecar] | None = None,
    sft: bool = False,
    **gpt_kwargs: Any,
) -> tuple[type, GPTDatasetConfig]:
    """The Megatron dataset class for ``padding`` and its config.

    Args:
        padding: The run's data flags.
        pad_multiple: Resolved pack-length multiple (:meth:`PaddingConfig.pad_multiple`); packed
            data only (the self-padded ``GPTDataset`` always fills ``sequence_length``).
        doc_pad_multiple: Every packed document padded to a multiple of this (2*CP under CP).
        sidecars: Extra per-token sidecars for packed data (e.g. routes); refused otherwise.
        sft: Megatron's ``--sft`` (its CP pad multiple comes from ``gpt_kwargs``).
        **gpt_kwargs: ``GPTDatasetConfig`` fields (``random_seed``, ``sequence_length``, ...).

    Returns:
        ``SelfPaddedSFTDataset`` under ``--sft``, ``PackedDataset`` under ``--pack-documents``,
        else ``SelfPaddedGPTDataset``; with its config.

    Raises:
        ValueError: On sidecars without ``--pack-documents`` or any bad config value.
    """
    common = PadFillFields.values_of(padding)
    if sft:
        if sidecars:
            raise ValueError(f"sidecars {sorted(sidecars)} cannot be read beside --sft's JSONL")
        # Imported here: Megatron's SFTDataset module imports megatron.training (its whole loop).
        from megatron_ext.data.sft_dataset import SelfPaddedSFTDataset, SFTDatasetConfig

        return SelfPaddedSFTDataset, SFTDatasetConfig(
            **gpt_kwargs,
            **common,
            sft_packing=padding.sft_packing,
            packing_algorithm=padding.packing_algorithm,
            packing_window=padding.packing_window,
            pack_overlong_policy=padding.pack_overlong_policy,
        )
    if not padding.pack_documents:
        if sidecars:
            raise ValueError(f"sidecars {sorted(sidecars)} need --pack-documents")
        return SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig(**gpt_kwargs, **common)
    return PackedDataset, PackedDatasetConfig(
        **gpt_kwargs,
        **common,
        pad_to_seq_len=padding.pad_to_seq_len,
        pad_to_multiple_of=pad_multiple,
        doc_pad_multiple=doc_pad_multiple,
        packing_algorithm=padding.packing_algorithm,
        packing_window=padding.packing_window,
        pack_overlong_policy=padding.pack_overlong_policy,
        loss_mask_suffix=padding.pack_loss_mask_suffix,
        sidecars=dict(sidecars or {}),
    )
