"""Tier: pure (Megatron's padding rule, real IndexedDataset files): token ids must fit the vocabulary."""

import argparse

import numpy as np
import pytest

from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.training.vocab_check import check_vocabulary, max_token_id


def _args(prefix: str, vocab: int, divisible_by: int = 128, **extra) -> argparse.Namespace:
    return argparse.Namespace(
        tokenizer_type="NullTokenizer", vocab_size=vocab, make_vocab_size_divisible_by=divisible_by,
        tensor_model_parallel_size=1, rank=0, data_path=["0.5", prefix, "0.5", prefix], **extra,
    )  # fmt: skip


@pytest.fixture
def byte_prefix(tmp_path) -> str:
    """Byte-level documents ending with the end-of-document id 256, as tools/preprocess_data.py writes."""
    prefix = str(tmp_path / "bytes")
    docs = [np.array([104, 105, 256], dtype=np.int64), np.array([7, 256], dtype=np.int64)]
    write_documents(prefix, docs, np.uint16)
    return prefix


def test_max_token_id_reads_the_bin(byte_prefix):
    assert max_token_id(byte_prefix) == 256


def test_vocab_256_is_refused_naming_the_flag_and_file(byte_prefix):
    # 256 is already a multiple of 128: Megatron builds 256 embedding rows, and id 256 overflows.
    with pytest.raises(ValueError, match=r"--vocab-size 256 .*bytes\.bin holds token id 256"):
        check_vocabulary(_args(byte_prefix, 256))


def test_data_listed_in_a_data_args_file_is_checked_too(byte_prefix, tmp_path):
    # Megatron reads --data-args-path's prefixes itself; the check reads the same list, so a
    # corpus named only there is refused like one on --data-path (a weight is never a prefix).
    listed = tmp_path / "data_args.txt"
    listed.write_text(f"1.0 {byte_prefix}\n")
    args = _args(byte_prefix, 256, data_args_path=str(listed))
    args.data_path = None
    with pytest.raises(ValueError, match=r"bytes\.bin holds token id 256"):
        check_vocabulary(args)
    check_vocabulary(_args(byte_prefix, 257, data_args_path=str(listed)))  # fits: no error


def test_vocab_257_fits(byte_prefix):
    check_vocabulary(_args(byte_prefix, 257))  # padded to 384 rows


def test_padding_can_make_a_small_vocab_fit(byte_prefix):
    # 200 ids padded to a multiple of 128 -> 256 rows, still too few; padded to 300 -> fits.
    with pytest.raises(ValueError, match="256 rows"):
        check_vocabulary(_args(byte_prefix, 200))
    check_vocabulary(_args(byte_prefix, 257, divisible_by=300))


def test_an_id_inside_the_padded_embedding_but_beyond_the_vocabulary_is_refused(tmp_path):
    # --vocab-size 200 is padded to 256 embedding rows: id 210 indexes a row, but one Megatron
    # only added to pad the embedding, which no id of the run's tokenizer names.
    prefix = str(tmp_path / "wider")
    write_documents(prefix, [np.array([3, 210, 199])], np.uint16)
    with pytest.raises(ValueError) as err:
        check_vocabulary(_args(prefix, 200))
    message = str(err.value)
    assert "--vocab-size 200 " in message and "wider.bin holds token id 210" in message
    assert "beyond the tokenizer's 200 ids" in message and "at least 211 ids" in message
    check_vocabulary(_args(prefix, 211))  # the id is inside the vocabulary itself


def test_a_bin_of_another_dtype_than_its_idx_is_named_not_misread(tmp_path):
    """uint16 tokens beside the int32 .idx of the same documents: the sizes disagree, and the
    refusal says so (as tools/pack_stats.py's does) instead of reading int32 ids out of uint16
    pairs (256 and 104 read as 16777320: "holds token id 16777320")."""
    docs = [np.array([104, 105, 256]), np.array([7, 256])]
    write_documents(str(tmp_path / "narrow"), docs, np.uint16)
    write_documents(str(tmp_path / "wide"), docs, np.int32)
    prefix = str(tmp_path / "mixed")
    (tmp_path / "mixed.bin").write_bytes((tmp_path / "narrow.bin").read_bytes())
    (tmp_path / "mixed.idx").write_bytes((tmp_path / "wide.idx").read_bytes())
    with pytest.raises(ValueError) as err:
        check_vocabulary(_args(prefix, 257))
    message = str(err.value)
    assert f"--data-path prefix {prefix}: data file {prefix}.bin has 10 bytes" in message
    assert f"{prefix}.idx indexes 20 (2 sequences of int32)" in message
    assert "those 5 tokens as 2-byte values" in message and "different dtypes" in message
    assert "holds token id" not in message and "\n" not in message


def test_an_idx_that_is_not_its_bins_is_refused_before_the_scan(byte_prefix):
    """The argument-time check (so --dry-run) opens each prefix through open_indexed: an .idx
    whose lengths were swapped in place (same size, same total, so the .bin's size still
    matches) is named, not scanned as if it described the .bin."""
    from tests.data.dataset_helpers import edit_index

    edit_index(byte_prefix, "lengths", [2, 3])
    with pytest.raises(
        ValueError,
        match=rf"^--data-path prefix {byte_prefix}: data file "
        rf"{byte_prefix}\.idx does not describe {byte_prefix}\.bin: its sequence 1",
    ):
        check_vocabulary(_args(byte_prefix, 257))


def test_padded_vocab_size_from_the_tokenizer_wins(byte_prefix):
    args = _args(byte_prefix, 1000, padded_vocab_size=256)  # what Megatron's tokenizer set
    with pytest.raises(ValueError, match="256 rows"):
        check_vocabulary(args)


@pytest.fixture(scope="module")
def small_hf_tokenizer(tmp_path_factory):
    """A Hugging Face tokenizer directory of 300 ids (a word-level vocabulary plus one added token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(299)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("hf") / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(str(path))
    return path


def test_a_local_hugging_face_tokenizer_is_checked_before_megatron_builds_it(
    tmp_path, small_hf_tokenizer
):
    """A dry run (no tokenizer built, so no padded_vocab_size) still sees the tokenizer's ids, as
    many as Megatron's own HuggingFaceTokenizer counts, and the error names --tokenizer-model."""
    from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer

    from megatron_ext.training.vocab_check import padded_vocab_size

    assert HuggingFaceTokenizer(str(small_hf_tokenizer)).vocab_size == 300  # Megatron's count
    prefix = str(tmp_path / "wide")
    write_documents(prefix, [np.array([5, 599])], np.uint16)  # tokenized with a larger vocabulary
    args = _args(prefix, None, tokenizer_model=str(small_hf_tokenizer))
    args.tokenizer_type = "HuggingFaceTokenizer"
    assert padded_vocab_size(args) == 384  # 300 padded to a multiple of 128, as Megatron pads
    with pytest.raises(ValueError) as err:
        check_vocabulary(args)
    assert f"--tokenizer-model {small_hf_tokenizer} (--tokenizer-type HuggingFaceTokenizer)" in str(
        err.value
    )
    assert "holds token id 599" in str(err.value) and "--vocab-size" not in str(err.value)
    write_documents(prefix + "_dummy", [np.array([5, 383])], np.uint16)  # the last padded row
    args.data_path = [prefix + "_dummy"]
    with pytest.raises(ValueError, match="holds token id 383, beyond the tokenizer's 300 ids"):
        check_vocabulary(args)
    write_documents(prefix + "_fits", [np.array([5, 299])], np.uint16)  # the tokenizer's last id
    args.data_path = [prefix + "_fits"]
    check_vocabulary(args)


def test_a_tokenizer_megatron_cannot_load_here_is_left_to_megatron(tmp_path):
    """A sentencepiece-only directory (or any Megatron cannot load in this environment): no
    vocabulary is known, the pre-check passes, and Megatron's own build decides."""
    from megatron_ext.training.vocab_check import padded_vocab_size

    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    (slow / "tokenizer.model").write_bytes(b"")  # not a sentencepiece model
    args = _args(str(tmp_path / "none"), None, tokenizer_model=str(slow))
    args.tokenizer_type = "HuggingFaceTokenizer"
    assert padded_vocab_size(args) is None
    check_vocabulary(args)  # no refusal, no traceback


def test_the_scan_is_kept_by_file_identity_and_redone_for_a_rewritten_file(tmp_path, monkeypatch):
    """A second launch reads the cached largest id, not the .bin; rewriting the data (same prefix,
    same sizes) gets a fresh scan, so a cached answer can never pass data it was not built from."""
    prefix, cache = str(tmp_path / "docs"), str(tmp_path / "cache")
    write_documents(prefix, [np.array([1, 2, 200], dtype=np.int64)], np.uint16)
    assert max_token_id(prefix, cache_dir=cache) == 200
    real_memmap = np.memmap
    reads = []
    monkeypatch.setattr(np, "memmap", lambda *a, **k: reads.append(a) or real_memmap(*a, **k))
    assert max_token_id(prefix, cache_dir=cache) == 200
    assert reads == [], "an unchanged .bin was read again"
    with open(prefix + ".bin", "r+b") as f:  # the .bin alone rewritten in place, same size
        f.seek(4)
        f.write(np.uint16(300).tobytes())
    assert max_token_id(prefix, cache_dir=cache) == 300
    assert reads, "the rewritten .bin was not read"


def test_check_vocabulary_caches_beside_the_data_unless_a_cache_path_is_given(
    byte_prefix, tmp_path
):
    cache = tmp_path / "elsewhere"
    check_vocabulary(_args(byte_prefix, 257, data_cache_path=str(cache)))
    assert [p.name.endswith("-value.txt") for p in cache.iterdir()] == [True]
    check_vocabulary(_args(byte_prefix, 257))
    beside = tmp_path / "cache" / "PackedDataset_indices"
    assert [p.name.endswith("-value.txt") for p in beside.iterdir()] == [True]
    with pytest.raises(ValueError, match="holds token id 256"):  # the cached id still refuses
        check_vocabulary(_args(byte_prefix, 256))
