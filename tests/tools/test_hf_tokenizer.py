"""A Hugging Face tokenizer directory, the path a user takes: tools/preprocess_data.py tokenizes with it
and Megatron's real loop trains with ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``.

Tier: Megatron on one rank (Megatron's own ``HuggingFaceTokenizer`` class, IndexedDataset files) and one
subprocess launch (Megatron's real ``pretrain``, 2 gloo ranks with torchrun's environment, CPU, about 10 s).

The directory is built here, offline: a byte-level BPE (600 ids, ``<|endoftext|>`` = id 0) trained on
the embedded corpus and saved with ``PreTrainedTokenizerFast.save_pretrained`` (``tokenizer.json`` +
``tokenizer_config.json``), the layout a downloaded model's tokenizer has.
"""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, launch
from tests.tools.test_preprocess_data import load_tool, run_cli

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "megatron_ext" / "assets" / "corpus.jsonl"
VOCAB, EOS = 600, "<|endoftext|>"


def corpus_texts() -> list[str]:
    return [json.loads(line)["text"] for line in CORPUS.read_text("utf-8").splitlines()]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A Hugging Face tokenizer directory: byte-level BPE trained on the embedded corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(), trainer)
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id(EOS) == 0
    path = tmp_path_factory.mktemp("hf") / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(str(path))
    assert {p.name for p in path.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    return path


@pytest.fixture(scope="module")
def corpus_prefix(tokenizer_dir, tmp_path_factory) -> str:
    """The embedded corpus tokenized by preprocess_data with the directory (eos from its config)."""
    prefix = str(tmp_path_factory.mktemp("data") / "corpus")
    argv = ["--input", str(CORPUS), "--output-prefix", prefix, "--append-eod"]
    assert load_tool().main([*argv, "--tokenizer-model", str(tokenizer_dir)]) == 0
    return prefix


def test_preprocess_with_a_tokenizer_directory_matches_megatrons_tokenizer(
    tokenizer_dir, corpus_prefix, tmp_path
) -> None:
    from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import (
        HuggingFaceTokenizer,
    )

    megatron_tok = HuggingFaceTokenizer(str(tokenizer_dir))  # what the training run loads
    assert megatron_tok.vocab_size == VOCAB
    texts = corpus_texts()
    ds = IndexedDataset(corpus_prefix)
    assert len(ds) == len(texts)
    for i in (0, 1, len(texts) - 1):
        want = [*megatron_tok.text_to_ids(texts[i]), 0]  # + the directory's eos_token id
        assert ds[i].tolist() == want
    ids = np.concatenate([ds[i] for i in range(len(ds))])
    # Not byte-level data: BPE merges (ids above 256) are most of the tokens, all inside the vocab.
    assert ids.max() < VOCAB and (ids > 256).mean() > 0.5
    # The bare tokenizer.json with an explicit --eod-id gives the same ids.
    out = str(tmp_path / "file")
    argv = ["--input", str(CORPUS), "--output-prefix", out, "--append-eod", "--eod-id", "0"]
    assert load_tool().main([*argv, "--tokenizer-file", str(tokenizer_dir / "tokenizer.json")]) == 0
    again = IndexedDataset(out)
    assert all(np.array_equal(again[i], ds[i]) for i in range(len(ds)))


def test_tokenizer_directory_bad_inputs_give_one_line_errors(tokenizer_dir, tmp_path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "a stubborn clock"}\n')
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    no_eos = tmp_path / "no_eos"
    no_eos.mkdir()
    (no_eos / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (no_eos / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    bad_eos = tmp_path / "bad_eos"
    bad_eos.mkdir()
    (bad_eos / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (bad_eos / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    cases = [
        ([str(empty)], "is a directory without tokenizer.json"),
        ([str(no_eos), "--append-eod"], "needs --eod-id .*names an eos_token"),
        # Megatron's tokenizer adds an eos_token missing from the vocabulary as id 600.
        ([str(bad_eos), "--append-eod", "--eod-id", "601"], r"--eod-id 601 .*\(601 ids\)"),
        ([str(tokenizer_dir), "--append-eod", "--eod-id", str(VOCAB)], r"\(600 ids\)"),
        ([str(tokenizer_dir / "tokenizer.json"), "--append-eod"], "needs --eod-id"),
    ]
    for n, (extra, match) in enumerate(cases):
        argv = ["--input", str(src), "--output-prefix", str(tmp_path / f"o{n}"), "--tokenizer-file"]
        rc, err = run_cli([*argv, *extra])
        assert rc == 2 and err.count("\n") == 1 and re.search(match, err), (extra, err)
        assert not (tmp_path / f"o{n}.idx").exists()


def test_real_loop_trains_with_the_tokenizer_directory(tokenizer_dir, corpus_prefix) -> None:
    args = list(TINY_MOE_TEST_ARGS)
    at = args.index("--vocab-size")  # the tokenizer sets Megatron's vocabulary, not --vocab-size
    del args[at : at + 2]
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_dir)]
    # No HF_HUB_OFFLINE (a user's shell): a local directory is read without the network. Ranks
    # forked from the preloaded server, which has not imported transformers: the rank imports it.
    info = ["--logging-level", "20"]  # Megatron's INFO line on the padded vocabulary is read below
    run = launch([*args, *hf, *info, "--data-path", corpus_prefix, "--train-iters", "3"]).check()
    assert run.preloaded, run.not_forked_because
    # Megatron padded the BPE's 600 ids to a multiple of 128 (the byte-level data would give 384).
    assert re.search(
        r"padded vocab \(size: 600\) with 40 dummy tokens \(new size: 640\)", run.output
    )
    losses = run.losses
    assert sorted(losses) == [1, 2, 3], run.output[-2000:]
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[3] < losses[1]
    # From random init the first loss is near ln(640): logits over the tokenizer's padded vocab.
    assert abs(losses[1] - math.log(640)) < 1.0
