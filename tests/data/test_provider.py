"""Tests for megatron_ext.data.provider. Tier: Megatron on one rank (real builder, no group)."""

import numpy as np
import pytest
from megatron.core.tokenizers import MegatronTokenizer

from megatron_ext.config import PaddingConfig
from megatron_ext.data.gpt_dataset import SelfPaddedGPTDataset
from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.data.packed_dataset import PackedDataset, Sidecar
from megatron_ext.data.provider import build_datasets


def gpt_kwargs(prefix: str) -> dict:
    tok = MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null-text"}, vocab_size=64
    )
    return {
        "random_seed": 1,
        "sequence_length": 16,
        "blend": ([prefix], None),
        "split": "100,0,0",
        "tokenizer": tok,
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "create_attention_mask": False,
    }


def test_flags_choose_the_dataset(tmp_path) -> None:
    prefix = str(tmp_path / "d")
    rng = np.random.default_rng(0)
    write_documents(
        prefix, [rng.integers(1, 60, size=int(n)) for n in rng.integers(2, 20, 30)]
    )
    kw = gpt_kwargs(prefix)
    gpt = build_datasets(PaddingConfig(), [10, 0, 0], lambda: True, **kw)[0]
    assert type(gpt) is SelfPaddedGPTDataset and "padding_mask" in gpt[0]
    padding = PaddingConfig(pack_documents=True, packing_algorithm="sequential")
    packed = build_datasets(padding, [10, 0, 0], lambda: True, pad_multiple=8, **kw)[0]
    assert (
        type(packed) is PackedDataset
        and packed.config.packing_algorithm == "sequential"
    )
    assert all(packed[i]["tokens"].numel() % 8 == 0 for i in range(len(packed)))
    with pytest.raises(
        ValueError, match=r"sidecars \['routes'\] need --pack-documents"
    ):
        build_datasets(
            PaddingConfig(),
            [10, 0, 0],
            lambda: True,
            sidecars={"routes": Sidecar("_r")},
            **kw,
        )
