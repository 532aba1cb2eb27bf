"""tools/preprocess_data.py writes the bytes Megatron-LM's own tools/preprocess_data.py writes.

Tier: Megatron on one rank (Megatron-Core 0.19.2's tokenizer builder and IndexedDatasetBuilder;
the tool in-process, and with --workers 2 its worker processes).

The expected files are built by
:func:`~megatron_ext.bench.megatron_preprocess.megatron_preprocess`, which drives Megatron's
installed classes (``build_tokenizer``, ``IndexedDatasetBuilder``, ``DType``) as Megatron-LM's
tools/preprocess_data.py drives them (NVIDIA/Megatron-LM commit
00736f4c796c3b9b4bc0609320064a0afdcd8edc; the script is not in the megatron-core wheel).
"""

import json
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.bench.megatron_preprocess import megatron_preprocess, megatron_tokenizer
from tests.tools.test_preprocess_data import load_tool, run_cli
from tests.tools.tokenizer_dirs import bpe_dir, corpus_texts, word_dir

#: A vocabulary over Megatron's uint16 limit (65500) whose ids all fit uint16 (< 65536).
LARGE = 65520


def records(words: bool = False) -> list[dict]:
    """The embedded corpus as two keys, with empty records and sentence lists mixed in."""
    texts = corpus_texts()
    if words:  # word-level ids, the top ones among them
        texts = [
            " ".join(f"w{(i * 7919 + j * 104729) % (LARGE - 2)}" for j in range(i % 9))
            for i in range(60)
        ]
        texts += [f"w{LARGE - 3} w{LARGE - 4} unknown"]
    rows = [{"text": t, "title": t[: len(t) // 3]} for t in texts]
    rows[2] = {"text": "", "title": ""}
    rows[3] = {"text": [texts[3], "", texts[4]], "title": ["", ""]}
    rows[5] = {"text": [], "title": [texts[5]]}
    rows[7]["title"] = [texts[7][:5], texts[7][5:]]
    return rows


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tokenizers")
    return {
        "bos": bpe_dir(base / "bos", bos=True),
        "plain": bpe_dir(base / "plain"),
        "large": word_dir(base / "large", LARGE),
    }


def files(prefix: str) -> tuple[bytes, bytes]:
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


CASES = [
    # (tokenizer, our/Megatron's flags, --append-eod)
    ("bos", [], True),
    ("bos", ["--tokenizer-hf-no-include-special-tokens"], True),
    ("plain", [], True),
    ("plain", [], False),
    ("large", [], True),
]


@pytest.mark.parametrize("name, flags, eod", CASES, ids=[f"{c[0]}{c[1]}{c[2]}" for c in CASES])
def test_output_is_megatrons_byte_for_byte(dirs, tmp_path, name, flags, eod) -> None:
    rows = records(words=name == "large")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(dirs[name])]
    keys = ["text", "title"]
    expected = str(tmp_path / "megatron")
    megatron_preprocess(str(src), expected, tokenizer + flags, keys, eod)
    ours = str(tmp_path / "ours")
    argv = ["--input", str(src), "--output-prefix", ours, "--json-keys", *keys, *tokenizer, *flags]
    assert load_tool().main(argv + (["--append-eod"] if eod else [])) == 0
    for key in keys:
        assert files(f"{ours}_{key}_document") == files(f"{expected}_{key}_document"), key
    # Not vacuous: the cases these runs exist for occurred in the expected data.
    ds = IndexedDataset(f"{expected}_text_document")
    docs = ds.document_indices
    assert (np.diff(docs) == 0).any() and (np.diff(docs) > 1).any()  # empty and multi-sentence
    first = ds[0].tolist()
    assert (first[0] == 1) == (name == "bos" and not flags)  # BOS <s> = 1 exactly when included
    assert (first[-1] == ds[0][-1] and (ds[0][-1] == (0 if name != "large" else LARGE - 1))) == eod
    if name == "large":  # int32, though every id would fit uint16
        assert (
            ds.index.dtype == np.int32
            and int(np.concatenate([ds[i] for i in range(len(ds))]).max()) < 2**16
        )


def test_workers_write_the_same_bytes(dirs, tmp_path, monkeypatch) -> None:
    """--workers 2 (processes, chunks of a few lines here) equals one process byte for byte."""
    from megatron_ext.data import encode_workers

    monkeypatch.setattr(encode_workers, "CHUNK_LINES", 7)  # many chunks, out of step with workers
    rows = records() * 3
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    outs = []
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}")
        argv = ["--input", str(src), "--output-prefix", prefix, "--json-keys", "text", "title"]
        argv += ["--tokenizer-model", str(dirs["bos"]), "--append-eod", "--workers", str(workers)]
        assert load_tool().main(argv) == 0
        outs.append([files(f"{prefix}_{k}_document") for k in ("text", "title")])
    assert outs[0] == outs[1]
    assert len(IndexedDataset(str(tmp_path / "w1_text_document")).document_indices) == len(rows) + 1


def test_batched_ids_equal_megatrons_one_text_at_a_time(dirs) -> None:
    """The tool encodes a chunk of texts in one call; Megatron's script one text per call."""
    from megatron_ext.data.text_tokenizers import TokenizerSpec, load_tokenizer

    texts = corpus_texts() + ["", " ", "<s> literal", "<|endoftext|>"]
    for include in (True, False):
        flags = [] if include else ["--tokenizer-hf-no-include-special-tokens"]
        megatron = megatron_tokenizer(
            [
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                str(dirs["bos"]),
                *flags,
            ]
        )
        ours = load_tokenizer(TokenizerSpec(str(dirs["bos"]), include))
        assert ours.vocab_size == megatron.vocab_size and ours.eos_id == megatron.eod
        got = [ids.tolist() for ids in ours.encode_batch(texts, True)]
        assert got == [megatron.tokenize(t) for t in texts]


def test_prompt_response_records_get_the_bos_once_and_loss_masked(dirs, tmp_path) -> None:
    """Prompt/response records (this project's): the tokenizer's BOS starts the prompt only, with
    loss mask 0; a tokenizer that adds tokens after a text is refused for them in one line."""
    src = tmp_path / "sft.jsonl"
    src.write_text(json.dumps({"prompt": "a stubborn", "response": " clock"}) + "\n")
    prefix = str(tmp_path / "sft")
    argv = ["--input", str(src), "--prompt-key", "prompt", "--response-key", "response"]
    argv += ["--tokenizer-model", str(dirs["bos"]), "--append-eod"]
    assert load_tool().main([*argv, "--output-prefix", prefix]) == 0
    megatron = megatron_tokenizer(
        ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(dirs["bos"])]
    )
    prompt, response = megatron.tokenize("a stubborn"), megatron.tokenize(" clock")[1:]
    tokens, mask = IndexedDataset(prefix), IndexedDataset(prefix + "_loss_mask")
    assert prompt[0] == 1 and tokens[0].tolist() == [*prompt, *response, 0]
    assert mask[0].tolist() == [0] * len(prompt) + [1] * (len(response) + 1)

    from tokenizers import Tokenizer, processors

    both = tmp_path / "both"
    both.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (dirs["bos"] / name).exists():
            (both / name).write_bytes((dirs["bos"] / name).read_bytes())
    tok = Tokenizer.from_file(str(both / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A <|endoftext|>", special_tokens=[("<s>", 1), ("<|endoftext|>", 0)]
    )
    tok.save(str(both / "tokenizer.json"))
    rc, err = run_cli([*argv[:-3], "--tokenizer-model", str(both), "--output-prefix", prefix + "2"])
    assert rc == 2 and "adds special tokens after each text" in err and "Traceback" not in err
