"""Tier: pure (numpy). megatron_ext.replay.route_records: JSONL lines -> documents, a JSON list
being a batch (one record per element, named ``file:line[i]``), and the vLLM record forms."""

import json

import numpy as np
import pytest

from megatron_ext.replay.route_records import documents_of_line, read_documents
from tests.tools import engine_encoders as enc


def test_batched_list_is_one_record_per_element_in_order():
    answers = [
        enc.sglang_generate([1, 2], [3], enc.sglang_base64(np.full((3, 1, 1), v, np.int32), 0))
        for v in (4, 5)
    ]
    docs = documents_of_line(json.dumps(answers), "sglang", "f:1", 1, 1, 0)
    assert [d.name for d in docs] == ["f:1[0]", "f:1[1]"]
    assert [int(d.rows_TLK[0, 0, 0]) for d in docs] == [4, 5]
    with pytest.raises(ValueError, match="f:1: an empty JSON list holds no record"):
        documents_of_line("[]", "sglang", "f:1", 1, 1, 0)


def test_vllm_records_of_each_payload_form(tmp_path):
    rows = np.array([[[1, 2]], [[3, 4]]], dtype=np.uint8)
    lines = [
        {"routed_experts": enc.vllm_numpy2base64(rows), "num_tokens": 3},  # vLLM 0.34 array
        {"routed_experts": rows.tolist(), "token_ids": [7, 8, 9]},  # nested lists
        {
            "routed_experts": enc.vllm_numpy2base64(rows),
            "num_tokens": 5,
            "routed_experts_prompt_start": 2,
        },  # fmt: skip
    ]
    path = tmp_path / "v.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    docs = list(read_documents([str(path)], "vllm"))
    assert [d.num_tokens for d in docs] == [3, 3, 5] and [d.start for d in docs] == [0, 0, 2]
    assert all(np.array_equal(d.rows_TLK, rows) for d in docs)
    assert docs[0].rows_TLK.dtype == np.uint8  # the .npy header's
