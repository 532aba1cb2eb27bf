"""Tests for megatron_ext.data.gpt_dataset. Tier: Megatron on one rank (real IndexedDataset,
GPTDataset, BlendedMegatronDatasetBuilder; no process group)."""

import os
import re

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_ext.data.gpt_dataset import (
    SelfPaddedGPTDataset,
    SelfPaddedGPTDatasetConfig,
    document_lengths_from_index,
)
from megatron_ext.data.gpt_index_cache import AFFIXES
from megatron_ext.data.indexed_writer import write_documents
from tests.data.dataset_helpers import build_splits, gpt_config_kwargs, null_tokenizer
from tests.filesystems import read_only_dir, tiny_tmpfs

SEQ = 5
EOD = 127  # the null tokenizer's eod at vocab 128
#: Megatron's document mask (``inter_document_masking``): megatron-core 0.19 on, not 0.18.2.
DOCUMENT_MASK = "inter_document_masking" in GPTDatasetConfig.__dataclass_fields__


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("gpt")
    write_documents(str(root / "a"), [np.arange(1, 8), np.arange(20, 25)])  # 12 tokens
    write_documents(str(root / "b"), [np.arange(40, 49)])
    # Documents ending in eod, one with an eod inside: 4 + 5 + 4 = 13 tokens.
    write_documents(str(root / "eod"), [[3, 4, 5, EOD], [6, EOD, 7, 8, EOD], [9, 10, 11, EOD]])
    return [str(root / "a"), str(root / "b"), str(root / "eod")]


def build(cls, config_cls, prefixes, weights=None, split="0,100,0", sizes=(None,) * 3, **kw):
    config = config_cls(
        **gpt_config_kwargs(
            prefixes,
            sequence_length=SEQ,
            weights=weights,
            split=split,
            drop_last_partial_validation_sequence=False,  # Megatron then pads the last sample
            **kw,
        )
    )
    return build_splits(cls, config, list(sizes))


# Without the document mask on megatron-core 0.18.2 too (its lengths read off the index).
@pytest.mark.parametrize(
    "inter_document_masking",
    [
        pytest.param(False, marks=pytest.mark.each_megatron),
        pytest.param(True, marks=pytest.mark.skipif(not DOCUMENT_MASK, reason="0.18.2: no mask")),
    ],
)
def test_short_sample_is_self_padded_and_matches_megatron_on_real_tokens(
    prefixes: list[str], inter_document_masking: bool
) -> None:
    kw = {"inter_document_masking": True} if inter_document_masking else {}  # 0.18.2: no field
    ref = build(GPTDataset, GPTDatasetConfig, prefixes[:1], **kw)[1]
    ours = build(SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, prefixes[:1], **kw)[1]
    assert len(ours) == len(ref) == 3
    padded = 0
    for i in range(len(ref)):
        r, o = ref[i], ours[i]
        n = int((~o["padding_mask"]).sum())
        assert torch.equal(r["tokens"][:n], o["tokens"][:n])
        assert torch.equal(r["loss_mask"], o["loss_mask"])  # Megatron masks its pads; we match
        assert torch.equal(r["labels"][r["loss_mask"].bool()], o["labels"][o["loss_mask"].bool()])
        if n < SEQ:
            padded += 1
            # Text [23 24] (one real label), sequence_length 5: pads cycle the sample's tokens.
            assert o["tokens"].tolist() == [23, 24, 23, 24, 23]
            assert r["tokens"].tolist() == [23, 24, 0, 0, 0]
            assert o["padding_mask"].tolist() == [False, False, True, True, True]
            if inter_document_masking:  # pads get their own segment, positions restart
                assert o["cu_seqlens"].tolist() == [0, 2, 5, 5, 5, 5]
                assert o["position_ids"].tolist() == [0, 1, 0, 1, 2]
                assert int(o["max_seqlen"]) == 3
        elif inter_document_masking:
            assert torch.equal(r["cu_seqlens"], o["cu_seqlens"])
            assert torch.equal(r["position_ids"], o["position_ids"])
    assert padded == 1


@pytest.mark.parametrize("extra_token", [True, False])
def test_constant_policy_reproduces_megatron(prefixes: list[str], extra_token: bool) -> None:
    """Bitwise Megatron's samples, with and without its extra label token per sample
    (``add_extra_token_to_sequence``: without it the last input's label is Megatron's pad)."""
    kw = {"add_extra_token_to_sequence": extra_token}
    ref = build(GPTDataset, GPTDatasetConfig, prefixes[:1], **kw)[1]
    ours = build(
        SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, prefixes[:1], pad_policy="constant", **kw
    )[1]
    assert len(ref) > 0
    padded = 0
    for i in range(len(ref)):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(ref[i][key], ours[i][key]), (key, i)
        padded += bool(ours[i]["padding_mask"].any())
    assert padded > 0  # a short, padded sample was compared too


@pytest.mark.parametrize("extra_token", [True, False])
def test_self_policy_keeps_megatrons_real_labels(prefixes: list[str], extra_token: bool) -> None:
    """Self pads change no real token's input or trained label, with or without the extra token;
    a label is trained only where its next token is real text."""
    kw = {"add_extra_token_to_sequence": extra_token}
    ref = build(GPTDataset, GPTDatasetConfig, prefixes[:1], **kw)[1]
    ours = build(SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, prefixes[:1], **kw)[1]
    padded = 0
    for i in range(len(ref)):
        r, o = ref[i], ours[i]
        n = int((~o["padding_mask"]).sum())
        assert torch.equal(r["tokens"][:n], o["tokens"][:n])
        trained = o["loss_mask"].bool()
        assert torch.equal(r["loss_mask"], o["loss_mask"])
        assert torch.equal(r["labels"][trained], o["labels"][trained])
        if n < SEQ:
            padded += 1
            assert not trained[max(n - 1, 0) :].any()
            assert o["tokens"][n:].tolist() != [0] * (SEQ - n)  # pads are text, not Megatron's 0
    assert padded > 0


@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_eos_equal_to_pad_id_is_kept_and_trained(prefixes: list[str], eod_mask_loss: bool) -> None:
    # A tokenizer whose pad id is its eod (allowed with allow_ambiguous_pad_tokens): Megatron
    # compares ids with the pad id, so it zeroes every real eod and masks every eod label.
    kw = {
        "tokenizer": null_tokenizer(128, pad_id=EOD),
        "allow_ambiguous_pad_tokens": True,
        "eod_mask_loss": eod_mask_loss,
    }
    ref = build(GPTDataset, GPTDatasetConfig, prefixes[2:], **kw)[1]
    ours = build(SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, prefixes[2:], **kw)[1]
    real_eod_inputs = real_eod_labels = megatron_zeroed = padded = 0
    for i in range(len(ours)):
        o, r = ours[i], ref[i]
        # Reference: the raw text Megatron reads (its pad slots hold the pad id = EOD).
        text, doc_lens = ours._text_and_document_lengths(i)  # Megatron's query (0.18.2: + index)
        num_text = sum(doc_lens)
        n = min(num_text, SEQ)
        padded += num_text < SEQ
        assert o["padding_mask"].tolist() == [j >= n for j in range(SEQ)]
        assert o["tokens"][:n].tolist() == text[:n].tolist()  # no real id remapped
        for j in range(SEQ):
            real_label = j + 1 < num_text  # by position: the next text token is real
            if real_label:
                assert int(o["labels"][j]) == text[j + 1]
                real_eod_labels += text[j + 1] == EOD
            expected = float(real_label and not (eod_mask_loss and text[j] == EOD))
            assert float(o["loss_mask"][j]) == expected, (i, j)  # eod_mask_loss kept
            if j < n and text[j] == EOD:
                real_eod_inputs += 1
                megatron_zeroed += int(r["tokens"][j]) == 0
    # The interesting cases occurred: real eods as inputs and labels, Megatron zeroed them, and
    # a short sample was padded.
    assert real_eod_inputs > 0 and real_eod_labels > 0 and padded > 0
    assert megatron_zeroed == real_eod_inputs


@pytest.mark.skipif(
    not DOCUMENT_MASK, reason="megatron-core 0.18.2 returns no document lengths to compare with"
)
@pytest.mark.parametrize("extra_token", [True, False])
def test_document_lengths_read_off_the_index_are_megatrons(prefixes, extra_token) -> None:
    """megatron-core 0.18.2's sample query returns no document lengths: those read off the
    index (its path) are the ones 0.19.2's returns, for every sample, spanning documents too."""
    for prefix in prefixes:
        kw = {"add_extra_token_to_sequence": extra_token}
        dataset = build(GPTDataset, GPTDatasetConfig, [prefix], split="100,0,0", **kw)[0]
        spanning = 0
        for idx in range(len(dataset)):
            *_, lengths = dataset._query_document_sample_shuffle_indices(idx)
            assert document_lengths_from_index(dataset, idx) == lengths, (prefix, idx)
            spanning += len(lengths) > 1
        assert spanning > 0 or prefix == prefixes[1]  # b is one 9-token document


def test_batch_padding_sample_is_all_pads(prefixes: list[str]) -> None:
    kw = {"inter_document_masking": True} if DOCUMENT_MASK else {}
    ds = build(SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, prefixes[:1], **kw)[1]
    s = ds[None]
    assert s["padding_mask"].all() and not s["loss_mask"].any()
    if DOCUMENT_MASK:
        assert s["cu_seqlens"].tolist() == [0, SEQ] + [SEQ] * (SEQ - 1)
    assert s["position_ids"].tolist() == list(range(SEQ))
    assert len(set(s["tokens"].tolist())) > 1  # self-padded from sample 0, not one constant id
    assert not ds[0]["padding_mask"].any()  # a real sample read after it is unaffected


def test_blends_with_weights_through_megatrons_builder(prefixes: list[str]) -> None:
    train, _, _ = build(
        SelfPaddedGPTDataset,
        SelfPaddedGPTDatasetConfig,
        prefixes[:2],
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
        ({"weights": [1.0, -2.0]}, "--data-path weight -[12].0 for .* finite and > 0"),
        ({"weights": [0.0, 0.0]}, "--data-path weight 0.0 for"),
    ],
)
def test_bad_inputs(prefixes: list[str], kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, prefixes[:2], **kw)


def test_rewritten_data_rebuilds_megatrons_index_cache(tmp_path) -> None:
    # Megatron keys GPTDataset's index cache by the flags; rewritten data at the same prefix
    # reused the old sample index. SelfPaddedGPTDataset adds the data's identity to the key.
    prefix, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    samples = []
    for docs in ([np.arange(1, 8)], [np.arange(30, 33), np.arange(40, 52)]):
        write_documents(prefix, docs)
        train = build(
            SelfPaddedGPTDataset,
            SelfPaddedGPTDatasetConfig,
            [prefix],
            split="100,0,0",
            path_to_cache=cache,
        )[0]
        real = np.concatenate(docs)
        for i in range(len(train)):
            s = train[i]
            n = int((~s["padding_mask"]).sum())
            assert set(s["tokens"][:n].tolist()) <= set(real.tolist())
        samples.append(len(train))
    assert samples[0] != samples[1]  # the second index was built from the new lengths
    assert len({f.split("-")[0] for f in os.listdir(cache)}) == 2


def test_bin_size_is_checked_on_the_non_packed_path_too(tmp_path) -> None:
    prefix = str(tmp_path / "cut")
    write_documents(prefix, [np.arange(1, 9)])
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(8)
    with pytest.raises(ValueError, match=r"--data-path file .*cut\.bin has 8 bytes but"):
        build(SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, [prefix], split="100,0,0")


@pytest.mark.parametrize("pad_id, match", [(-1, "must be >= 0"), (128, "outside the tokenizer")])
def test_bad_pad_constant_id_via_the_python_api(prefixes: list[str], pad_id, match) -> None:
    with pytest.raises(ValueError, match=f"--pad-constant-id .*{match}"):
        build(
            SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, prefixes[:1], pad_constant_id=pad_id
        )


def test_a_full_disk_leaves_no_partial_index_cache_file(prefixes, tmp_path) -> None:
    """Megatron's GPTDataset wrote its index cache straight into place: a full disk stopped
    ``numpy.save`` partway with an OSError traceback and left a partial ``.npy`` there (and a
    killed writer, one a later run loads). Now the files are built in a temporary directory and
    renamed in whole; the failed write is one ValueError naming the file and the cause."""
    with tiny_tmpfs(tmp_path / "full", size="4k") as cache:
        with pytest.raises(ValueError) as err:
            build(SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, prefixes[:1],
                  split="100,0,0", path_to_cache=str(cache))  # fmt: skip
        assert os.listdir(cache) == []  # nothing partial, no temporary directory
    line = str(err.value)
    assert re.match(
        rf"cannot write the index cache {cache}/\w+-SelfPaddedGPTDataset-train-"
        r"(document|sample|shuffle)_index\.npy \(No space left on device\); point "
        "--data-cache-path at a writable directory",
        line,
    ), line
    assert "\n" not in line


def test_an_unwritable_cache_directory_is_one_error_naming_it(prefixes, tmp_path) -> None:
    with read_only_dir(tmp_path / "ro") as ro:
        with pytest.raises(ValueError, match=f"cannot write the index cache directory {ro}/c "):
            build(SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, prefixes[:1],
                  split="100,0,0", path_to_cache=str(ro / "c"))  # fmt: skip


def test_the_index_cache_renamed_into_place_is_megatrons_own(prefixes, tmp_path) -> None:
    """Built once (renamed into place), then loaded by Megatron's own cache-hit path: the same
    samples, and nothing but its four files per split in the directory."""
    kw = dict(split="100,0,0", path_to_cache=str(tmp_path / "c"))
    first = build(SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, prefixes[:1], **kw)[0]
    files = sorted(os.listdir(tmp_path / "c"))
    assert [f.split("-", 1)[1] for f in files] == [
        f"SelfPaddedGPTDataset-train-{a}" for a in sorted(AFFIXES)
    ]
    again = build(SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, prefixes[:1], **kw)[0]
    assert sorted(os.listdir(tmp_path / "c")) == files
    for i in range(len(first)):
        assert torch.equal(first[i]["tokens"], again[i]["tokens"])
