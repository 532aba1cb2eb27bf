"""Tier: pure (numpy). megatron_ext.replay.sglang_routes on records built to SGLang's layout by hand:
``meta_info.routed_experts`` = base64 of the little-endian int32 bytes of ``[T - 1, L, K]``."""

import base64

import numpy as np
import pytest

from megatron_ext.replay.sglang_routes import (
    decode_sglang_base64,
    decode_sglang_record,
    sglang_num_tokens,
)
from tests.import_probe import imported_from


def b64_int32(rows) -> str:
    """What SGLang's detokenizer sends: base64 of the int32 tensor's raw bytes (no shape)."""
    return base64.b64encode(np.asarray(rows, dtype="<i4").tobytes()).decode("ascii")


def test_worked_example_of_the_module_docstring():
    # L = 1, K = 2, T = 3: rows for tokens 0 and 1 only; bytes 01 00 00 00 04 00 00 00 ...
    payload = b64_int32([[[1, 4]], [[0, 2]]])
    assert base64.b64decode(payload)[:8] == bytes([1, 0, 0, 0, 4, 0, 0, 0])
    record = {"meta_info": {"prompt_tokens": 2, "completion_tokens": 1, "routed_experts": payload}}
    (doc,) = decode_sglang_record(record, num_layers=1, topk=2, name="r:1")
    assert doc.num_tokens == 3 and doc.rows_TLK.dtype == np.int32 and doc.exact
    assert doc.rows_TLK.tolist() == [[[1, 4]], [[0, 2]]]


def test_sample_tokens_and_nested_lists_and_counts_that_must_agree():
    rows = [[[3, 1], [0, 2]]] * 4  # T - 1 = 4 rows, L = 2, K = 2
    sample = {"tokens": list(range(5)), "meta_info": {"routed_experts": rows}}
    (doc,) = decode_sglang_record(sample, num_layers=2, topk=2, name="s:1")
    assert doc.num_tokens == 5 and doc.rows_TLK.tolist() == rows
    both = {**sample, "meta_info": {**sample["meta_info"], "prompt_tokens": 3}}
    both["meta_info"]["completion_tokens"] = 2
    assert sglang_num_tokens(both, "s:1") == 5
    both["meta_info"]["completion_tokens"] = 3
    with pytest.raises(ValueError, match="= 6 disagrees with the 5 tokens"):
        sglang_num_tokens(both, "s:1")
    with pytest.raises(ValueError, match="different lengths"):
        sglang_num_tokens({"tokens": [1], "token_ids": [1, 2], "meta_info": {}}, "s:1")
    assert sglang_num_tokens({"meta_info": {}}, "s:1") is None  # T then comes from the bytes


def test_rows_are_exactly_t_minus_1_never_chosen_by_the_byte_count():
    flat = np.arange(24) % 8  # 24 ids
    payload = b64_int32(flat)
    # T unknown: whole rows of L * K = 4 ids -> 6 rows (the tool then needs T to accept them).
    assert decode_sglang_base64(payload, None, num_layers=2, topk=2, name="x").shape == (6, 2, 2)
    # T = 7: 6 = T - 1 rows. T = 6 would be 6 = T rows: refused (SGLang never sends T rows).
    assert decode_sglang_base64(payload, 7, num_layers=2, topk=2, name="x").shape == (6, 2, 2)
    with pytest.raises(ValueError, match=r"24 int32 ids are not T - 1 = 5 rows"):
        decode_sglang_base64(payload, 6, num_layers=2, topk=2, name="x")
    # A start offset of 2: rows [2, T - 1) -> T = 9.
    assert decode_sglang_base64(payload, 9, num_layers=2, topk=2, name="x", start=2).shape[0] == 6
    # T = 4: 3 rows x K = 2 -> 24 ids are 4 layers (SGLang counted every decoder layer).
    with pytest.raises(ValueError, match=r"24 int32 ids are not T - 1 = 3 rows .* 4 layers"):
        decode_sglang_base64(payload, 4, num_layers=2, topk=2, name="x")
    with pytest.raises(ValueError, match="not whole int32 expert ids"):
        decode_sglang_base64(
            base64.b64encode(b"\0" * 6).decode(), None, num_layers=1, topk=1, name="x"
        )
    # T = 1: no row at all, an empty payload.
    assert decode_sglang_base64("", 1, num_layers=2, topk=2, name="x").shape == (0, 2, 2)


def test_int64_payload_of_a_two_token_record_is_refused_not_read_as_two_rows():
    """The true rows of a T = 3 record are [[1, 2]], [[3, 4]] (L = 1, K = 2, T - 1 = 2 rows).
    Sent as int64 by mistake, its 32 bytes are 8 int32 ids = 4 rows; for a T = 2 record (one
    row) they would have been read as two full rows [[1, 0]], [[2, 0]] with exit status 0."""
    wrong = base64.b64encode(np.array([[[1, 2]], [[3, 4]]], dtype="<i8").tobytes()).decode()
    record = {"meta_info": {"prompt_tokens": 1, "completion_tokens": 1, "routed_experts": wrong}}
    with pytest.raises(ValueError, match=r"8 int32 ids are not T - 1 = 1 rows"):
        decode_sglang_record(record, num_layers=1, topk=2, name="r:1")


def test_module_never_imports_megatron():
    assert imported_from(["megatron_ext.replay.sglang_routes"], ["megatron"]) == []
