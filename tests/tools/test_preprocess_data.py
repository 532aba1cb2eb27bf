"""Round-trip tests for tools/preprocess_data.py (and megatron_ext.data.jsonl_documents).
Tier: Megatron on one rank (IndexedDataset files; the tool runs in-process via its main())."""

import importlib.util
import json
import os
import re

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.data.jsonl_documents import BYTE_EOD_ID, RecordFormat, encode_chunk
from megatron_ext.data.text_tokenizers import TokenizerSpec, load_tokenizer

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


def test_encode_chunk_directly() -> None:
    """Sentences with no ids are dropped, eod ends the last kept one; an empty text is a
    document of no sequences, without eod; blank lines are no records."""
    lines = [b'{"t": "ab"}\n', b"\n", b'{"t": ["c", "", "de"]}\n', b'{"t": ""}\n', b'{"t": []}']
    fmt = RecordFormat(keys=("t",), eod_id=9)
    chunk = encode_chunk(lines, 1, fmt, load_tokenizer(TokenizerSpec(None)))
    assert chunk.ids[0].tolist() == [97, 98, 9, 99, 100, 101, 9]
    assert chunk.seq_lens[0].tolist() == [3, 1, 3]
    assert chunk.doc_seqs[0].tolist() == [1, 2, 0, 0]


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
    import tokenizers  # in the tools extra and requirements/lock.txt: never skipped
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a b a c"}])
    argv = ["--input", src, "--output-prefix", str(tmp_path / "o")]
    assert load_tool().main([*argv, "--tokenizer-file", str(tmp_path / "tokenizer.json")]) == 0
    ds = IndexedDataset(str(tmp_path / "o"))  # kept alive: ds[0] is a view of its mmap
    assert ds[0].tolist() == [0, 1, 0, 2]  # "c" is unknown: [UNK] = 2


def run_cli(argv: list[str]) -> tuple[int, str]:
    """The tool as a user runs it: one line on stderr and exit status 2 for a user error."""
    import contextlib
    import io

    from megatron_ext.data.tool_errors import run_tool

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_tool(load_tool().main, argv)
    return rc, err.getvalue()


SFT = ["--prompt-key", "prompt", "--response-key", "response"]

#: (case, JSONL content, extra flags, expected one-line message)
BAD_INPUTS = [
    ("eod -1", '{"text": "a"}', ["--append-eod", "--eod-id", "-1"], r"--eod-id must be in \[0, "),
    ("eod 2**31", '{"text": "a"}', ["--append-eod", "--eod-id", str(2**31)], "--eod-id must be"),
    ("eod 2**32", '{"text": "a"}', ["--append-eod", "--eod-id", str(2**32)], "--eod-id must be"),
    ("empty JSONL", "", [], r"in\.jsonl holds no records"),
    ("blank lines only", "\n\n", [], "holds no records"),
    ("non-UTF-8", b'{"text": "a"}\n\xff\xfe\n', [], r"in\.jsonl line 2: not UTF-8"),
    (
        "empty --loss-mask-suffix",
        '{"prompt": "a", "response": "b"}',
        [*SFT, "--loss-mask-suffix", ""],
        "--loss-mask-suffix must not be empty",
    ),
    (
        "existing output",
        '{"text": "a"}',
        ["--output-prefix", "{tmp}/old"],
        r"old\.bin already exists; pass --overwrite",
    ),
    (
        "existing loss mask",
        '{"prompt": "a", "response": "b"}',
        [*SFT, "--output-prefix", "{tmp}/lonely"],
        r"lonely_loss_mask\.bin already exists",
    ),
    (
        "output is the input",
        '{"text": "a"}',
        ["--output-prefix", "{tmp}/in.jsonl.x", "--input", "{tmp}/in.jsonl.x.idx"],
        r"in\.jsonl\.x\.idx is an input",
    ),
    (
        "parent is a file",
        '{"text": "a"}',
        ["--output-prefix", "{tmp}/in.jsonl/o"],
        "is a file, not a directory",
    ),
    ("bad JSON", '{"text": "a"}\n{oops', [], r"in\.jsonl line 2 is not valid JSON"),
    ("missing key", '{"body": "a"}', [], r"line 1 has no string field 'text'"),
    (
        "prompt without response",
        '{"prompt": "a"}',
        ["--prompt-key", "prompt"],
        "--prompt-key and --response-key must be given together",
    ),
    ("missing input", '{"text": "a"}', ["--input", "{tmp}/nope.jsonl"], "nope.jsonl does not"),
    ("lone surrogate", '{"text": "ok"}\n{"text": "bad \\ud800"}', [], r"line 2 holds '\\ud800'"),
    ("key twice", '{"text": "a", "text": "b"}', [], r"line 1: key 'text' appears twice"),
    ("only empty texts", '{"text": ""}\n{"text": ""}', [], "holds only empty documents"),
    ("sentence not a string", '{"text": ["a", 3]}', [], r"line 1 has no string field 'text'"),
    ("keys twice", '{"text": "a"}', ["--json-keys", "text", "text"], "names a key twice"),
    ("both key flags", '{"text": "a"}', ["--json-keys", "a", "--text-key", "b"], "alternatives"),
    ("keys and prompt", '{"text": "a"}', [*SFT, "--json-keys", "a"], "replace --json-keys"),
    ("no workers", '{"text": "a"}', ["--workers", "0"], "--workers must be at least 1"),
    (
        "type, no model",
        '{"text": "a"}',
        ["--tokenizer-type", "HuggingFaceTokenizer"],
        "needs --tok",
    ),
    (
        "one key empty",
        '{"text": "a", "t": ""}',
        ["--json-keys", "text", "t"],
        r"only empty documents \(0 tokens\) for .*o_t_document",
    ),
]


@pytest.mark.parametrize(
    "content, extra, match", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_inputs_give_one_line_errors(tmp_path, content, extra, match) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(content if isinstance(content, bytes) else content.encode())
    (tmp_path / "in.jsonl.x.idx").write_text("x")
    for name in ("old.bin", "old.idx", "lonely_loss_mask.bin"):
        (tmp_path / name).write_text("keep me")
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "o")]
    argv += [a.replace("{tmp}", str(tmp_path)) for a in extra]
    rc, err = run_cli(argv)
    errors = [line for line in err.splitlines() if "error" in line]  # besides the progress bar
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("error: ") and re.search(match, errors[0]), err
    assert not os.path.exists(tmp_path / "o.idx")
    assert (tmp_path / "old.bin").read_text() == "keep me"  # nothing existing was touched
    assert (tmp_path / "in.jsonl.x.idx").read_text() == "x"
    with pytest.raises(ValueError, match=match):
        run_cli([*argv, "--debug"])


def test_overwrite_replaces_and_removes_the_stale_loss_mask(tmp_path) -> None:
    src = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "a", "response": "bc"}])
    prefix = str(tmp_path / "d")
    load_tool().main(["--input", src, "--output-prefix", prefix, *SFT])
    assert os.path.exists(prefix + "_loss_mask.idx")
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "xyz"}, {"text": "q"}])
    with pytest.raises(ValueError, match="already exists"):
        load_tool().main(["--input", text, "--output-prefix", prefix])
    load_tool().main(["--input", text, "--output-prefix", prefix, "--overwrite"])
    assert not os.path.exists(prefix + "_loss_mask.idx")  # stale: it described the old data
    assert not os.path.exists(prefix + "_loss_mask.bin")
    ds = IndexedDataset(prefix)
    assert ds.sequence_lengths.tolist() == [3, 1]


def test_a_failed_overwrite_keeps_the_old_data_and_its_loss_mask(tmp_path, monkeypatch) -> None:
    """Tokens and mask are written before any old file goes: a write that fails (here the disk
    fills while writing the new tokens) leaves the old tokens with their mask, byte for byte."""
    from megatron_ext.data import indexed_writer

    src = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "a", "response": "bc"}])
    prefix = str(tmp_path / "d")
    tool = load_tool()
    tool.main(["--input", src, "--output-prefix", prefix, *SFT])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("d")}
    assert "d_loss_mask.idx" in before
    real = indexed_writer.StreamingPrefixes.add_documents
    written = []

    def fills_up(self, output, *arrays):
        if written:  # the second output: the tokens (the mask is written first)
            raise OSError("disk full")
        written.append(output)
        return real(self, output, *arrays)

    monkeypatch.setattr(indexed_writer.StreamingPrefixes, "add_documents", fills_up)
    again = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "xy", "response": "z"}])
    with pytest.raises(OSError, match="disk full"):
        tool.main(["--input", again, "--output-prefix", prefix, *SFT, "--overwrite"])
    assert written  # the mask had been written when the tokens failed
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("d")}
    assert after == before


@pytest.mark.parametrize("with_mask, kill_after", [(True, 1), (True, 2), (True, 3), (False, 1)])
def test_a_run_killed_while_publishing_leaves_no_old_mask_beside_new_tokens(
    tmp_path, monkeypatch, with_mask, kill_after
) -> None:
    """A kill between two renames of the commit: the old mask (same lengths, other split: it
    would load and silently train prompt tokens) never stays loadable beside the new tokens."""
    src = write_jsonl(tmp_path / "v1.jsonl", [{"prompt": "ab", "response": "cd"}])
    prefix = str(tmp_path / "d")
    tool = load_tool()
    tool.main(["--input", src, "--output-prefix", prefix, *SFT])
    renames = []
    real_replace = os.replace

    def killed_after(tmp, final):
        if len(renames) == kill_after:
            raise KeyboardInterrupt  # killed mid-commit
        renames.append(final)
        real_replace(tmp, final)

    monkeypatch.setattr(os, "replace", killed_after)
    rows = [{"prompt": "a", "response": "bcd"}] if with_mask else [{"text": "abcd"}]
    flags = SFT if with_mask else []
    v2 = write_jsonl(tmp_path / "v2.jsonl", rows)
    with pytest.raises(KeyboardInterrupt):
        tool.main(["--input", v2, "--output-prefix", prefix, *flags, "--overwrite"])
    monkeypatch.setattr(os, "replace", real_replace)
    assert len(renames) == kill_after  # killed between renames, some new file in place
    tokens_load = os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin")
    mask_load = os.path.exists(prefix + "_loss_mask.idx")
    assert not (tokens_load and mask_load), renames
    assert not tokens_load  # the tokens' .idx is the commit's last file: not in place yet
    if mask_load:  # what loads is new, never the old mask
        mask = IndexedDataset(prefix + "_loss_mask")  # kept alive: items view its mmap
        assert mask[0].tolist() == [0, 1, 1, 1]


def test_an_empty_loss_mask_suffix_is_refused_even_without_prompt_key(tmp_path) -> None:
    """The suffix names the stale mask that --overwrite removes: empty, that is the tokens."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "ab"}])
    prefix = str(tmp_path / "d")
    tool = load_tool()
    tool.main(["--input", src, "--output-prefix", prefix])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("d")}
    with pytest.raises(ValueError, match="--loss-mask-suffix must not be empty"):
        tool.main(["--input", src, "--output-prefix", prefix, "--overwrite", "--loss-mask-suffix="])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("d")} == before


def test_a_lone_old_loss_mask_needs_overwrite(tmp_path) -> None:
    """New tokens beside a mask left from other data would be read with it: refused unless
    --overwrite, which removes it."""
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "a", "response": "bc"}])
    prefix = str(tmp_path / "d")
    tool = load_tool()
    tool.main(["--input", sft, "--output-prefix", prefix, *SFT])
    for ext in (".bin", ".idx"):
        os.unlink(prefix + ext)  # the tokens gone, their mask left behind
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "xyz"}])
    with pytest.raises(ValueError, match="_loss_mask.*already exists"):
        tool.main(["--input", text, "--output-prefix", prefix])
    tool.main(["--input", text, "--output-prefix", prefix, "--overwrite"])
    assert not os.path.exists(prefix + "_loss_mask.idx")
    ds = IndexedDataset(prefix)
    assert ds.sequence_lengths.tolist() == [3]


def test_large_token_ids_are_stored_exactly(tmp_path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "ab"}])
    prefix = str(tmp_path / "big")
    load_tool().main(
        ["--input", src, "--output-prefix", prefix, "--append-eod", "--eod-id", str(2**31 - 1)]
    )
    ds = IndexedDataset(prefix)
    assert ds[0].dtype == np.int32 and ds[0].tolist() == [97, 98, 2**31 - 1]


def test_an_output_prefix_named_like_the_input_file_can_be_rewritten(tmp_path) -> None:
    """``--output-prefix d/in.jsonl`` writes d/in.jsonl.bin/.idx; the JSONL is a file, not a
    prefix, so rerunning with --overwrite replaces them (it was refused as 'is an input')."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "ab"}])
    tool = load_tool()
    tool.main(["--input", src, "--output-prefix", src])
    with pytest.raises(ValueError, match="already exists"):
        tool.main(["--input", src, "--output-prefix", src])
    assert tool.main(["--input", src, "--output-prefix", src, "--overwrite"]) == 0
    ds = IndexedDataset(src)
    assert ds.sequence_lengths.tolist() == [2]
    assert (tmp_path / "in.jsonl").read_text().startswith('{"text"')  # the input untouched


def test_a_tokenizer_without_unk_is_a_one_line_error(tmp_path) -> None:
    """A word-level tokenizer.json without [UNK] meets an unknown word: the Rust library raises a
    bare Exception (Megatron's script dies with its traceback); here one line names the
    tokenizer, the input line and the library's reason, with exit status 2 and no output."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1}))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a b"}, {"text": "a c"}])
    argv = ["--input", src, "--output-prefix", str(tmp_path / "o")]
    for flag in ("--tokenizer-file", "--tokenizer-model"):
        rc, err = run_cli([*argv, flag, str(tmp_path / "tokenizer.json")])
        errors = [line for line in err.splitlines() if "error" in line]
        assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
        assert re.search(
            rf"{flag} .*tokenizer\.json cannot tokenize .*in\.jsonl line 2: .*Missing \[UNK\]",
            errors[0],
        ), err
        assert not os.path.exists(tmp_path / "o.bin")


def test_special_tokens_flag_without_a_tokenizer_warns(tmp_path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "ab"}])
    argv = ["--input", src, "--output-prefix", str(tmp_path / "o")]
    rc, err = run_cli([*argv, "--tokenizer-hf-no-include-special-tokens"])
    assert rc == 0 and "--tokenizer-hf-no-include-special-tokens has no effect" in err
    assert IndexedDataset(str(tmp_path / "o")).sequence_lengths.tolist() == [2]


def test_json_keys_write_one_output_per_key_named_as_megatron_does(tmp_path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"a": "xy", "b": ["p", "q"]}, {"a": "", "b": "r"}])
    prefix = str(tmp_path / "d")
    assert (
        load_tool().main(["--input", src, "--output-prefix", prefix, "--json-keys", "a", "b"]) == 0
    )
    a, b = IndexedDataset(prefix + "_a_document"), IndexedDataset(prefix + "_b_document")
    assert a.sequence_lengths.tolist() == [2] and a.document_indices.tolist() == [0, 1, 1]
    assert b.sequence_lengths.tolist() == [1, 1, 1] and b.document_indices.tolist() == [0, 2, 3]
    assert not os.path.exists(prefix + ".bin")


def test_record_and_tokenizer_modules_import_no_megatron() -> None:
    """The record logic is pure (numpy); Megatron is imported only to build a directory's
    tokenizer, when one is asked for."""
    import subprocess
    import sys

    code = (
        "import sys, megatron_ext.data.jsonl_documents, megatron_ext.data.text_tokenizers;"
        "bad = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
