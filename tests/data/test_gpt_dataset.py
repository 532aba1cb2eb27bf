"""Tests for megatron_ext.data.gpt_dataset. Tier: Megatron on one rank (real IndexedDataset,
GPTDataset, BlendedMegatronDatasetBuilder; no process group)."""

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.tokenizers import MegatronTokenizer

from megatron_ext.data.gpt_dataset import (
    SelfPaddedGPTDataset,
    SelfPaddedGPTDatasetConfig,
)
from megatron_ext.data.indexed_writer import write_documents

SEQ = 5


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("gpt")
    write_documents(str(root / "a"), [np.arange(1, 8), np.arange(20, 25)])  # 12 tokens
    write_documents(str(root / "b"), [np.arange(40, 49)])
    return [str(root / "a"), str(root / "b")]


def build(
    cls, config_cls, prefixes, weights=None, split="0,100,0", sizes=(None,) * 3, **kw
):
    tok = MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null-text"}, vocab_size=128
    )
    config = config_cls(
        random_seed=1,
        sequence_length=SEQ,
        blend=(prefixes, weights),
        split=split,
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        drop_last_partial_validation_sequence=False,  # Megatron then pads the last sample
        **kw,
    )
    return BlendedMegatronDatasetBuilder(cls, list(sizes), lambda: True, config).build()


@pytest.mark.parametrize("inter_document_masking", [False, True])
def test_short_sample_is_self_padded_and_matches_megatron_on_real_tokens(
    prefixes: list[str], inter_document_masking: bool
) -> None:
    kw = {"inter_document_masking": inter_document_masking}
    ref = build(GPTDataset, GPTDatasetConfig, prefixes[:1], **kw)[1]
    ours = build(SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, prefixes[:1], **kw)[
        1
    ]
    assert len(ours) == len(ref) == 3
    padded = 0
    for i in range(len(ref)):
        r, o = ref[i], ours[i]
        n = int((~o["padding_mask"]).sum())
        assert torch.equal(r["tokens"][:n], o["tokens"][:n])
        assert torch.equal(
            r["loss_mask"], o["loss_mask"]
        )  # Megatron masks its pads; we match
        assert torch.equal(
            r["labels"][r["loss_mask"].bool()], o["labels"][o["loss_mask"].bool()]
        )
        if n < SEQ:
            padded += 1
            # Text [23 24] (one real label), sequence_length 5: pads cycle the sample's tokens.
            assert o["tokens"].tolist() == [23, 24, 23, 24, 23]
            assert r["tokens"].tolist() == [23, 24, 0, 0, 0]
            assert o["padding_mask"].tolist() == [False, False, True, True, True]
            if inter_document_masking:  # pads get their own segment, positions restart
                assert o["cu_seqlens"].tolist() == [0, 2, 5, 5, 5, 5]
                assert o["position_ids"].tolist() == [0, 1, 0, 1, 2]
    assert padded == 1


def test_constant_policy_reproduces_megatron(prefixes: list[str]) -> None:
    ref = build(GPTDataset, GPTDatasetConfig, prefixes[:1])[1]
    ours = build(
        SelfPaddedGPTDataset,
        SelfPaddedGPTDatasetConfig,
        prefixes[:1],
        pad_policy="constant",
    )[1]
    for i in range(len(ref)):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(ref[i][key], ours[i][key]), key


def test_blends_with_weights_through_megatrons_builder(prefixes: list[str]) -> None:
    train, _, _ = build(
        SelfPaddedGPTDataset,
        SelfPaddedGPTDatasetConfig,
        prefixes,
        weights=[1.0, 3.0],
        split="100,0,0",
        sizes=(8, 0, 0),
    )
    assert isinstance(train, BlendedDataset) and len(train) == 8
    assert all(isinstance(d, SelfPaddedGPTDataset) for d in train.datasets)
    ids = {int(train[i]["dataset_id"]) for i in range(8)}
    assert ids == {0, 1} and all("padding_mask" in train[i] for i in range(8))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"pad_policy": "zeros"}, "unknown --pad-policy 'zeros'"),
        ({"weights": [1.0, -2.0]}, "--data-path weights must be >= 0"),
        ({"weights": [0.0, 0.0]}, "--data-path weights are all zero"),
    ],
)
def test_bad_inputs(prefixes: list[str], kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, prefixes, **kw)
