"""Tests for megatron_ext.data.provider. Tier: Megatron on one rank (real builder, no group)."""

import numpy as np
import pytest

from megatron_ext.data.gpt_dataset import SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig
from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.data.packed_dataset import PackedDataset, PackedDatasetConfig, Sidecar
from megatron_ext.data.provider import dataset_class_and_config
from megatron_ext.training.feature_configs import PaddingConfig
from tests.data.dataset_helpers import build_splits, gpt_config_kwargs


def test_flags_choose_the_dataset(tmp_path) -> None:
    prefix = str(tmp_path / "d")
    rng = np.random.default_rng(0)
    write_documents(prefix, [rng.integers(1, 60, size=int(n)) for n in rng.integers(2, 20, 30)])
    kw = gpt_config_kwargs([prefix], sequence_length=16, vocab_size=64)

    cls, config = dataset_class_and_config(PaddingConfig(), pad_multiple=8, **kw)
    assert cls is SelfPaddedGPTDataset and type(config) is SelfPaddedGPTDatasetConfig
    gpt = build_splits(cls, config, [10, 0, 0])[0]
    assert type(gpt) is SelfPaddedGPTDataset and "padding_mask" in gpt[0]

    padding = PaddingConfig(
        pack_documents=True, packing_algorithm="sequential", pad_policy="constant"
    )
    cls, config = dataset_class_and_config(padding, pad_multiple=8, **kw)
    assert cls is PackedDataset and type(config) is PackedDatasetConfig
    assert (config.pad_to_multiple_of, config.pad_policy) == (8, "constant")
    packed = build_splits(cls, config, [10, 0, 0])[0]
    assert type(packed) is PackedDataset and packed.config.packing_algorithm == "sequential"
    lengths = [packed[i]["tokens"].numel() for i in range(len(packed))]
    assert all(n % 8 == 0 for n in lengths) and len(set(lengths)) > 1  # really pad-to-multiple

    with pytest.raises(ValueError, match=r"sidecars \['routes'\] need --pack-documents"):
        dataset_class_and_config(
            PaddingConfig(), pad_multiple=1, sidecars={"routes": Sidecar("_r")}, **kw
        )
