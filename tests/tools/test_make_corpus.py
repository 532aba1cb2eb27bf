"""Tests for tools/make_corpus.py. Tier: pure (files; the tool runs in-process via its main())."""

import contextlib
import importlib.util
import io
import json
import os

import pytest

from megatron_ext.data.tool_errors import run_tool

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "make_corpus.py")


def load_tool():
    spec = importlib.util.spec_from_file_location("make_corpus", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deterministic_round_trip(tmp_path) -> None:
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    assert load_tool().main(["--docs", "5", "--out", a]) == 0
    assert load_tool().main(["--docs", "5", "--out", b]) == 0
    text = open(a, encoding="utf-8").read()
    assert text == open(b, encoding="utf-8").read()
    assert [json.loads(line)["text"] for line in text.splitlines()][0]  # 5 non-empty documents
    assert len(text.splitlines()) == 5


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--docs", "-5"], "--docs must be >= 1, got -5"),
        (["--docs", "0"], "--docs must be >= 1"),
        ([], r"old\.jsonl already exists; pass --overwrite"),
    ],
)
def test_bad_inputs_leave_the_old_file(tmp_path, extra, match) -> None:
    out = tmp_path / "old.jsonl"
    out.write_text("keep me")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_tool(load_tool().main, ["--out", str(out), *extra])
    assert rc == 2 and err.getvalue().count("\n") == 1
    assert __import__("re").search(match, err.getvalue())
    assert out.read_text() == "keep me"
    assert load_tool().main(["--out", str(out), "--docs", "2", "--overwrite"]) == 0
    assert len(out.read_text().splitlines()) == 2
