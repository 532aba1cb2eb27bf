"""A real Hugging Face tokenizer for Megatron's ``SFTTokenizer``, built offline, and SFT conversations
to train it on (the tests' and benchmarks' fixture; no user launch imports it).

Megatron's ``--tokenizer-type SFTTokenizer`` loads a tokenizer directory with
``transformers.AutoTokenizer`` and renders conversations with the chat template of
``--sft-tokenizer-prompt-format`` (megatron-core 0.19.2,
``megatron/core/tokenizers/text/libraries/sft_tokenizer.py``). The shipped formats name special
tokens the tokenizer must hold: ``nemotron-h-aligned`` writes ``<SPECIAL_10>`` / ``<SPECIAL_11>``
and pads with ``<SPECIAL_233>``; ``nemotron-nano-v2`` adds ``<SPECIAL_12>`` and pads with ``<unk>``.
:func:`build_sft_tokenizer` trains a small byte-level BPE (the ``tokenizers`` library) on the
package's embedded corpus, adds those tokens and an eos, and saves it with ``transformers``: no
network, about 0.1 s.

Byte-level pre-tokenization never merges across a newline or a special token, so a conversation
tokenizes to the concatenation of its turns' tokens, which ``SFTTokenizer`` asserts when it masks
the prompts.

Example::

    path = build_sft_tokenizer(tmp_dir)      # then --tokenizer-type SFTTokenizer --tokenizer-model path
    write_conversations(tmp_dir / "chat.jsonl", num_lines=64, seed=0)
"""

import json
import os

import numpy as np

#: Special tokens of Megatron's shipped prompt formats, plus an end of sequence.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<unk>",
    "</s>",
    "<SPECIAL_10>",
    "<SPECIAL_11>",
    "<SPECIAL_12>",
    "<SPECIAL_233>",
)
PROMPT_FORMAT = "nemotron-h-aligned"  # Megatron's default --sft-tokenizer-prompt-format


def _corpus_texts() -> list[str]:
    from importlib import resources

    text = resources.files("megatron_ext").joinpath("assets/corpus.jsonl").read_text("utf-8")
    return [json.loads(line)["text"] for line in text.splitlines()]


def build_sft_tokenizer(directory: str | os.PathLike, vocab_size: int = 384) -> str:
    """Trains a byte-level BPE on the embedded corpus and saves it as a ``transformers`` tokenizer.

    Args:
        directory: Where to save it (created).
        vocab_size: Ids in total (256 bytes, the special tokens, merges).

    Returns:
        The directory, for ``--tokenizer-model``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus_texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="</s>")
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(str(directory))
    return str(directory)


def conversation(rng: np.random.Generator, texts: list[str], turns: int) -> list[dict[str, str]]:
    """A system message then ``turns`` user/assistant pairs, their contents cut from ``texts``."""

    def content(low: int, high: int) -> str:
        text = texts[int(rng.integers(len(texts)))]
        words = text.split()
        return " ".join(words[: int(rng.integers(low, high))]) or "ok"

    messages = [{"role": "system", "content": content(1, 5)}]
    for _ in range(turns):
        messages.append({"role": "user", "content": content(2, 10)})
        messages.append({"role": "assistant", "content": content(2, 16)})
    return messages


def write_conversations(
    path: str | os.PathLike,
    *,
    num_lines: int,
    seed: int,
    conversations_per_line: tuple[int, int] = (1, 3),
    turns: tuple[int, int] = (1, 2),
) -> str:
    """Writes an SFT JSONL as Megatron's ``SFTLowLevelDataset`` reads it: one ``{"messages": [...]}``
    per line, each line one or more conversations, each starting with its system message.

    Args:
        path: The JSONL to write.
        num_lines: Lines.
        seed: Seeds the contents and counts.
        conversations_per_line: Inclusive range of conversations on a line.
        turns: Inclusive range of user/assistant pairs per conversation.

    Returns:
        ``path`` as a string.
    """
    rng = np.random.default_rng(seed)
    texts = _corpus_texts()
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_lines):
            messages: list[dict[str, str]] = []
            for _ in range(
                int(rng.integers(conversations_per_line[0], conversations_per_line[1] + 1))
            ):
                messages += conversation(rng, texts, int(rng.integers(turns[0], turns[1] + 1)))
            f.write(json.dumps({"messages": messages}) + "\n")
    return str(path)
