"""Tests for megatron_ext.data.empty_split. Tier: Megatron on one rank (real IndexedDataset,
BlendedMegatronDatasetBuilder, our GPTDataset and PackedDataset subclasses; no process group).

Megatron's ``GPTDataset`` never finishes building a split without tokens (its epoch loop adds
epochs of zero tokens forever), so each build here runs under a timeout: a regression fails
instead of hanging the suite.
"""

import os

import numpy as np
import pytest

from megatron_ext.data.gpt_dataset import SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig
from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.data.packed_dataset import PackedDataset, PackedDatasetConfig
from tests.data.dataset_helpers import build_splits, gpt_config_kwargs

SEQ = 8
DATASETS = [
    pytest.param(SelfPaddedGPTDataset, SelfPaddedGPTDatasetConfig, id="gpt"),
    pytest.param(PackedDataset, PackedDatasetConfig, id="packed"),
]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("empty_split")
    rng = np.random.default_rng(0)
    docs = lambda n: [rng.integers(1, 100, size=int(rng.integers(3, 12))) for _ in range(n)]  # noqa: E731
    write_documents(str(root / "tiny"), docs(10))
    write_documents(str(root / "big"), docs(100))
    write_documents(str(root / "holey"), docs(8) + [np.zeros(0, np.int32)] * 2)
    return str(root)


def build(cls, config_cls, prefixes, split, sizes, **kw):
    config = config_cls(**gpt_config_kwargs(prefixes, sequence_length=SEQ, split=split, **kw))
    return build_splits(cls, config, sizes)


def refusal(cls, config_cls, prefixes, split, sizes, **kw) -> str:
    """The message of the ValueError building these splits raises."""
    with pytest.raises(ValueError) as err:
        build(cls, config_cls, prefixes, split, sizes, **kw)
    return str(err.value)


#: (prefix, --split, samples asked, what the message says). 10 documents each.
REFUSALS = {
    # The validation share is round(9.9)..round(10): nothing.
    "valid_rounds_to_none": ("tiny", "99,1,0", [10, 5, 0], [
        "with --split 99,1,0: the valid split gets no documents (its share rounds to 0 of 10)",
        "5 samples are asked of it (--eval-iters evaluates on the validation split)",
        "set --eval-iters 0",
    ]),
    # 8 documents with tokens, then 2 empty ones: the validation split gets documents 8 and 9.
    "valid_of_empty_documents": ("holey", "80,20,0", [4, 2, 0], [
        "with --split 80,20,0: the valid split's 2 documents hold no tokens, yet 2 samples",
    ]),
    "train_rounds_to_none": ("tiny", "1,99,0", [10, 5, 0], [
        "the train split gets no documents", "--train-iters / --train-samples ask for them",
    ]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSALS))
@pytest.mark.parametrize(("cls", "config_cls"), DATASETS)
def test_samples_asked_of_a_split_without_tokens_are_refused(root, cls, config_cls, case):
    name, split, sizes, says = REFUSALS[case]
    prefix = os.path.join(root, name)
    message = refusal(cls, config_cls, [prefix], split, sizes)
    assert message.startswith(f"--data-path {prefix} (10 documents) with --split {split}: ")
    for text in says:
        assert text in message
    assert ("--eval-iters" in message) == (not case.startswith("train"))


@pytest.mark.parametrize(("cls", "config_cls"), DATASETS)
def test_a_split_without_documents_that_nothing_asks_of_builds_empty(root, cls, config_cls):
    # Megatron asks 0 samples of the validation split under --eval-iters 0; its GPTDataset then
    # still wants one extra label token from zero tokens and loops forever.
    train, valid, test = build(cls, config_cls, [os.path.join(root, "tiny")], "99,1,0", [10, 0, 0])
    assert len(valid) == 0 and test is None
    assert len(train) >= 10 and train[0]["tokens"].numel() == SEQ  # the run still trains


@pytest.mark.parametrize(("cls", "config_cls"), DATASETS)
def test_a_small_prefix_of_a_blend_is_named(root, cls, config_cls):
    # The big prefix's validation share is 2 documents; the tiny one's rounds to none.
    tiny, big = os.path.join(root, "tiny"), os.path.join(root, "big")
    message = refusal(cls, config_cls, [big, tiny], "98,2,0", [20, 4, 0], weights=[0.5, 0.5])
    assert f"--data-path {tiny} (10 documents)" in message
    assert "valid split gets no documents" in message


def test_the_full_validation_error_names_the_data_flag_given():
    from megatron_ext.data.empty_split import full_validation_error

    by_path = str(full_validation_error("99,1,0", ["0.5", "/d/a", "0.5", "/d/b"]))
    assert "--split 99,1,0 gives it no sample of --data-path 0.5 /d/a 0.5 /d/b" in by_path
    by_args = str(full_validation_error("99,1,0", None, "/d/blend.txt"))
    assert "no sample of --data-args-path /d/blend.txt" in by_args
    assert all(s.startswith("--full-validation evaluates") for s in (by_path, by_args))
