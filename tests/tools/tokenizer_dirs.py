"""Hugging Face tokenizer directories built offline for the tests (no hub access): what a
downloaded model's tokenizer holds (``tokenizer.json`` + ``tokenizer_config.json``, written by
``PreTrainedTokenizerFast.save_pretrained``), small enough to train in a second."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "megatron_ext" / "assets" / "corpus.jsonl"
EOS, BOS = "<|endoftext|>", "<s>"


def corpus_texts() -> list[str]:
    return [json.loads(line)["text"] for line in CORPUS.read_text("utf-8").splitlines()]


def bpe_dir(path: Path, vocab: int = 600, bos: bool = False) -> Path:
    """A byte-level BPE trained on the embedded corpus (``<|endoftext|>`` = 0, ``<s>`` = 1);
    with ``bos`` its post-processor puts ``<s>`` before every text (as Llama's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS, BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(), trainer)
    assert tok.get_vocab_size() == vocab and tok.token_to_id(EOS) == 0
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, 1)]
        )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=BOS).save_pretrained(
        str(path)
    )
    return path


def word_dir(path: Path, words: int) -> Path:
    """A word-level tokenizer of ``words`` ids (``w0`` .. ``w{words-3}``, ``[UNK]``, ``</s>``),
    its two files written directly (``save_pretrained`` takes seconds on a large vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(words - 2)} | {"[UNK]": words - 2, "</s>": words - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "</s>",
        "unk_token": "[UNK]",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
