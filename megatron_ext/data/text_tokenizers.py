"""The tokenizers of ``tools/preprocess_data.py``, loaded the way Megatron-LM's own preprocessing
loads them, so the two write the same ids.

Three kinds, each loaded in every ``--workers`` process from a picklable :class:`TokenizerSpec`:
the built-in byte-level one (ids 0..255, eod 256), a bare Hugging Face ``tokenizer.json``, and a
tokenizer directory built by Megatron-Core's own ``build_tokenizer``, whose post-processor's
special tokens start every text unless ``--tokenizer-hf-no-include-special-tokens``::

      "a stubborn clock" -> [1, 572, 461, 407]     BOS (id 1) included, Megatron's default
                         ->    [572, 461, 407]     --tokenizer-hf-no-include-special-tokens
"""

import dataclasses
import os
import types
from collections.abc import Callable, Sequence

import numpy as np

BYTE_VOCAB_SIZE = 257
BYTE_EOD_ID = 256

#: Texts -> ids per text (int64 arrays).
EncodeBatch = Callable[[Sequence[str], bool], list[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """What to load: picklable, so every worker process loads the same tokenizer."""

    path: str | None
    """``tokenizer.json`` file or tokenizer directory; None for the built-in byte-level one."""
    include_special_tokens: bool = True
    """Add the tokenizer's special tokens (its post-processor's, e.g. BOS) to every text."""
    flag: str = "--tokenizer-model"
    """The flag that named ``path``, for error messages."""


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A loaded tokenizer."""

    encode_batch: EncodeBatch
    """``(texts, special) -> ids per text``; ``special``: add the special tokens (if included)."""
    vocab_size: int
    """Ids it can produce, added tokens included (Megatron's ``tokenizer.vocab_size``)."""
    eos_id: int | None
    """Its end-of-document id (Megatron's ``tokenizer.eod``); None if it has none."""


def byte_encode(text: str) -> np.ndarray:
    """UTF-8 bytes as ids (int64)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def load_tokenizer(spec: TokenizerSpec) -> TextTokenizer:
    """Loads ``spec``'s tokenizer (ValueError naming the flag and file if missing or unreadable)."""
    if spec.path is None:
        return TextTokenizer(
            encode_batch=lambda texts, special: [byte_encode(t) for t in texts],
            vocab_size=BYTE_VOCAB_SIZE,
            eos_id=BYTE_EOD_ID,
        )
    if not os.path.exists(spec.path):
        raise ValueError(f"{spec.flag} {spec.path} does not exist")
    if os.path.isdir(spec.path):
        return _megatron_hf_tokenizer(spec)
    return _tokenizer_json(spec)


def _tokenizer_json(spec: TokenizerSpec) -> TextTokenizer:
    """A bare ``tokenizer.json`` (no ``eos_token``: ``--eod-id`` names it)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise ValueError(
            f"{spec.flag} {spec.path} needs the 'tokenizers' package (pip install -e .[tools])"
        ) from err
    try:
        tok = Tokenizer.from_file(spec.path)
    except Exception as err:  # the Rust library raises its own exception types
        raise ValueError(
            f"{spec.flag} {spec.path} is not a readable tokenizer.json: {err}"
        ) from err
    include = spec.include_special_tokens

    def encode_batch(texts: Sequence[str], special: bool) -> list[np.ndarray]:
        encodings = tok.encode_batch(list(texts), add_special_tokens=special and include)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    return TextTokenizer(
        encode_batch=encode_batch,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_id=None,
    )


def megatron_tokenizer_args(path: str, include_special_tokens: bool) -> types.SimpleNamespace:
    """The arguments Megatron-LM's ``tools/preprocess_data.py`` gives ``build_tokenizer`` for
    ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH`` (its parser's defaults)."""
    return types.SimpleNamespace(
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=path,
        chat_template=None,
        vocab_file=None,
        merge_file=None,
        special_tokens=None,
        tokenizer_hf_no_use_fast=False,
        trust_remote_code=False,
        tokenizer_hf_no_include_special_tokens=not include_special_tokens,
        metadata_path=None,
        pad_vocab_size=False,  # only the padded model vocabulary, unused here
    )


def _megatron_hf_tokenizer(spec: TokenizerSpec) -> TextTokenizer:
    """A tokenizer directory, built by Megatron-Core's ``build_tokenizer`` (no network), as
    ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` builds it: its ``eod`` the
    ``eos_token``, its ``vocab_size`` ``len(AutoTokenizer)``, added tokens included."""
    if not os.path.isfile(os.path.join(spec.path, "tokenizer.json")):
        raise ValueError(
            f"{spec.flag} {spec.path} is a directory without tokenizer.json (a Hugging Face "
            "tokenizer directory as save_pretrained writes it; slow-only tokenizers are not "
            "supported)"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: nothing to download
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    try:
        megatron_tok = build_tokenizer(
            megatron_tokenizer_args(spec.path, spec.include_special_tokens)
        )
    except ValueError as err:  # Megatron's "Unable to instantiate HuggingFace AutoTokenizer"
        raise ValueError(f"{spec.flag} {spec.path}: {' '.join(str(err).split())}") from err
    hf = megatron_tok._tokenizer.tokenizer  # the transformers tokenizer Megatron's tokenize calls
    include = spec.include_special_tokens

    def encode_batch(texts: Sequence[str], special: bool) -> list[np.ndarray]:
        # Megatron: tokenizer(text).input_ids with special tokens, else convert_tokens_to_ids(
        # tokenize(text)), one text at a time; one batch call per chunk gives the same ids per
        # text (tested against Megatron's tokenizer.tokenize).
        ids = hf(list(texts), add_special_tokens=special and include).input_ids
        return [np.asarray(i, dtype=np.int64) for i in ids]

    return TextTokenizer(
        encode_batch=encode_batch, vocab_size=megatron_tok.vocab_size, eos_id=megatron_tok.eod
    )


def special_prefix(tok: TextTokenizer, spec: TokenizerSpec) -> list[int]:
    """The ids the tokenizer puts before every text (e.g. ``[BOS]``), for prompt/response records.

    Raises:
        ValueError: It adds tokens after the text too (a prompt would end with them).
    """
    # Told apart on a one-character text: what special tokens add is the difference.
    with_special, plain = tok.encode_batch(["x"], True)[0], tok.encode_batch(["x"], False)[0]
    n = with_special.size - plain.size
    if n < 0 or not np.array_equal(with_special[n:], plain):
        raise ValueError(
            f"--prompt-key: {spec.flag} {spec.path} adds special tokens after each text "
            f"({with_special.tolist()} for 'x'), which would end the prompt; pass "
            "--tokenizer-hf-no-include-special-tokens (and --append-eod for the end)"
        )
    return with_special[:n].tolist()
