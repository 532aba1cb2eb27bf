"""Strict JSONL line reading shared by the preprocessor and the route converter."""

import json

import pytest

from megatron_ext.common.jsonl_lines import decode_line, refuse_duplicate_keys


def test_decode_line_gives_text_and_skips_blank_lines():
    assert decode_line('{"text": "é"}\n'.encode(), "f:1") == '{"text": "é"}\n'
    assert decode_line(b" \t\r\n", "f:2") is None
    assert decode_line(b"", "f:3") is None


def test_decode_line_names_a_line_that_is_not_utf8():
    with pytest.raises(ValueError, match=r"^in\.jsonl line 4: not UTF-8 \(invalid start byte\)$"):
        decode_line(b'{"text": "\xff"}\n', "in.jsonl line 4")


def test_duplicate_key_is_refused_with_its_name():
    assert json.loads('{"a": 1, "b": 2}', object_pairs_hook=refuse_duplicate_keys) == {
        "a": 1,
        "b": 2,
    }
    with pytest.raises(ValueError, match="key 'a' appears twice"):
        json.loads('{"a": 1, "b": {"a": 0}, "a": 2}', object_pairs_hook=refuse_duplicate_keys)
