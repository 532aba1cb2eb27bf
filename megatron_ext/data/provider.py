"""Builds the train/valid/test datasets a run asks for from its ``PaddingConfig``.

The one place that maps flags to dataset classes, for a ``train_valid_test_datasets_provider``:
``--pack-documents`` -> :class:`~megatron_ext.data.packed_dataset.PackedDataset`, otherwise the
self-padded ``GPTDataset``. ``gpt_kwargs`` are exactly what Megatron's ``GPTDatasetConfig`` takes
(``random_seed``, ``sequence_length``, ``blend``, ``split``, ``tokenizer``, ...)::

    padding = configs_from_args(args)[PaddingConfig]
    multiple = padding.pad_multiple(context_parallel_size=cp, fp8=fp8)
    train, valid, test = build_datasets(padding, [n_train, n_valid, n_test], is_built_on_rank,
                                        pad_multiple=multiple, **gpt_kwargs)
"""

from collections.abc import Callable
from typing import Any

from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

from megatron_ext.config import PaddingConfig
from megatron_ext.data.gpt_dataset import (
    SelfPaddedGPTDataset,
    SelfPaddedGPTDatasetConfig,
)
from megatron_ext.data.packed_dataset import PackedDataset, PackedDatasetConfig, Sidecar


def dataset_config(
    padding: PaddingConfig,
    *,
    pad_multiple: int = 1,
    sidecars: dict[str, Sidecar] | None = None,
    **gpt_kwargs: Any,
) -> GPTDatasetConfig:
    """The Megatron dataset config for ``padding`` (``PackedDatasetConfig`` or the GPT one).

    Args:
        padding: The run's data flags.
        pad_multiple: Resolved pack-length multiple (:meth:`PaddingConfig.pad_multiple`).
        sidecars: Extra per-token sidecars for packed data (e.g. routes); refused otherwise.
        **gpt_kwargs: ``GPTDatasetConfig`` fields.
    """
    common = {
        "pad_policy": padding.pad_policy,
        "pad_constant_id": padding.pad_constant_id,
        "multimodal_placeholder_ids": list(padding.multimodal_placeholder_ids),
    }
    if not padding.pack_documents:
        if sidecars:
            raise ValueError(f"sidecars {sorted(sidecars)} need --pack-documents")
        return SelfPaddedGPTDatasetConfig(**gpt_kwargs, **common)
    return PackedDatasetConfig(
        **gpt_kwargs,
        **common,
        pad_to_seq_len=padding.pad_to_seq_len,
        pad_to_multiple_of=pad_multiple,
        packing_algorithm=padding.packing_algorithm,
        packing_window=padding.packing_window,
        pack_overlong_policy=padding.pack_overlong_policy,
        loss_mask_suffix=padding.pack_loss_mask_suffix,
        sidecars=dict(sidecars or {}),
    )


def build_datasets(
    padding: PaddingConfig,
    sizes: list[int | None],
    is_built_on_rank: Callable[[], bool],
    *,
    pad_multiple: int = 1,
    sidecars: dict[str, Sidecar] | None = None,
    **gpt_kwargs: Any,
) -> list:
    """Train/valid/test datasets through Megatron's ``BlendedMegatronDatasetBuilder``."""
    config = dataset_config(
        padding, pad_multiple=pad_multiple, sidecars=sidecars, **gpt_kwargs
    )
    cls = PackedDataset if padding.pack_documents else SelfPaddedGPTDataset
    return BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()
