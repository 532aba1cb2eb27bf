"""Round-trip tests for tools/preprocess_data.py (and megatron_ext.data.jsonl_documents).
Tier: Megatron on one rank (IndexedDataset files; the tool runs in-process via its main())."""

import importlib.util
import json
import os

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.data.jsonl_documents import (
    BYTE_EOD_ID,
    byte_tokenizer,
    read_documents,
)

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "preprocess_data.py")


def load_tool():
    spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    return str(path)


def test_text_round_trip(tmp_path) -> None:
    texts = ["hello world", "é ok", "x"]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts] + [""])
    assert load_tool().main(["--input", src, "--output-prefix", str(tmp_path / "out")]) == 0
    ds = IndexedDataset(str(tmp_path / "out"))
    decoded = [bytes(ds[i].astype(np.uint8)).decode("utf-8") for i in range(len(ds))]
    assert decoded == texts
    assert not os.path.exists(str(tmp_path / "out_loss_mask.idx"))


def test_prompt_response_round_trip_with_loss_mask_and_eod(tmp_path) -> None:
    records = [
        {"prompt": "Q: 2+2?", "response": " 4"},
        {"prompt": "", "response": "hi"},
    ]
    src = write_jsonl(tmp_path / "sft.jsonl", records)
    prefix = str(tmp_path / "sft")
    argv = [
        "--input",
        src,
        "--output-prefix",
        prefix,
        "--prompt-key",
        "prompt",
        "--response-key",
        "response",
        "--append-eod",
    ]
    load_tool().main(argv)
    tokens, mask = IndexedDataset(prefix), IndexedDataset(prefix + "_loss_mask")
    assert tokens.sequence_lengths.tolist() == mask.sequence_lengths.tolist() == [10, 3]
    assert tokens[0].tolist() == list(b"Q: 2+2? 4") + [BYTE_EOD_ID]
    assert mask[0].tolist() == [0] * 7 + [1, 1, 1]
    assert mask[1].tolist() == [1, 1, 1]


def test_read_documents_directly() -> None:
    docs = list(read_documents(iter(['{"t": "ab"}']), byte_tokenizer, text_key="t", eod_id=9))
    assert docs[0][0].tolist() == [97, 98, 9] and docs[0][1].tolist() == [1, 1, 1]


@pytest.mark.parametrize(
    "lines, extra, match",
    [
        (['{"text": "a"}', "{oops"], [], r"in\.jsonl line 2 is not valid JSON"),
        (['{"body": "a"}'], [], r"in\.jsonl line 1 has no string field 'text'"),
        (
            ['{"prompt": "a"}'],
            ["--prompt-key", "prompt", "--response-key", "response"],
            r"line 1 has no string field 'response'",
        ),
        (
            ['{"text": "a"}'],
            ["--prompt-key", "prompt"],
            "--prompt-key and --response-key",
        ),
        (
            ['{"text": "a"}'],
            ["--tokenizer-file", "/nonexistent/tokenizer.json"],
            r"--tokenizer-file /nonexistent/tokenizer\.json does not exist",
        ),
    ],
)
def test_bad_inputs_name_the_problem(tmp_path, lines, extra, match) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    with pytest.raises(ValueError, match=match):
        load_tool().main(["--input", src, "--output-prefix", str(tmp_path / "o"), *extra])


def test_missing_input_file(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"--input .*nope\.jsonl does not exist"):
        load_tool().main(["--input", str(tmp_path / "nope.jsonl"), "--output-prefix", "x"])


def test_hf_tokenizer_file_round_trip(tmp_path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a b a c"}])
    load_tool().main(
        [
            "--input",
            src,
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer-file",
            str(tmp_path / "tokenizer.json"),
        ]
    )
    assert IndexedDataset(str(tmp_path / "o"))[0].tolist() == [0, 1, 0, 2]
