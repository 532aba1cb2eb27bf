"""Tier: pure (numpy). megatron_ext.replay.vllm_routes on answers built as vLLM's released source
builds them (tests/tools/engine_encoders.py: vLLM 0.34 ``utils/serial_utils.py`` numpy2base64 and
``entrypoints/openai/*/serving.py``; vLLM 0.21 ``v1/engine/output_processor.py``)."""

import base64
import io

import numpy as np
import pytest

from megatron_ext.replay.vllm_routes import decode_npy_base64, vllm_response_documents
from tests.tools import engine_encoders as enc


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
def test_npy_base64_keeps_the_headers_dtype_and_shape(dtype):
    rows = np.arange(2 * 3 * 2, dtype=dtype).reshape(2, 3, 2)
    got = decode_npy_base64(enc.vllm_numpy2base64(rows), "x")
    assert got.dtype == dtype and np.array_equal(got, rows)
    # The worked example of the protocol's comment: np.load(io.BytesIO(base64.b64decode(s))).
    s = enc.vllm_numpy2base64(rows)
    assert np.array_equal(np.load(io.BytesIO(base64.b64decode(s))), got)


def test_npy_base64_refusals():
    raw = base64.b64encode(np.zeros((2, 2), dtype=np.int32).tobytes()).decode()
    with pytest.raises(ValueError, match="does not hold a .npy file .*--format sglang"):
        decode_npy_base64(raw, "x")
    with pytest.raises(ValueError, match="integers, got float"):
        decode_npy_base64(enc.vllm_numpy2base64(np.zeros((1, 1, 1), dtype=np.float16)), "x")
    with pytest.raises(ValueError, match=r"expected \[tokens, layers, topk\], got shape \(4,\)"):
        decode_npy_base64(enc.vllm_numpy2base64(np.zeros(4, dtype=np.uint8)), "x")
    with pytest.raises(ValueError, match="not valid base64"):
        decode_npy_base64("@@", "x")


def test_completion_and_chat_responses_give_a_document_per_choice():
    prompt, completions = [1, 2, 3], [[4, 5], [6]]
    rows = [np.full((4, 2, 1), 1, np.uint8), np.full((3, 2, 1), 2, np.uint8)]
    for api in ("completion", "chat"):
        docs = vllm_response_documents(enc.vllm034_response(api, prompt, completions, rows), "f:1")
        assert [d.name for d in docs] == ["f:1 choice 0", "f:1 choice 1"]
        assert [d.num_tokens for d in docs] == [5, 4] and [d.start for d in docs] == [0, 0]
        assert all(np.array_equal(d.rows_TLK, r) for d, r in zip(docs, rows, strict=True))
    # routed_experts_prompt_start beyond the prompt: vLLM starts at the prompt's end.
    docs = vllm_response_documents(
        enc.vllm034_response("chat", prompt, completions, rows), "f:1", prompt_start=9
    )
    assert [d.start for d in docs] == [3, 3]


def test_response_refusals_name_the_choice():
    rows = [np.zeros((2, 1, 1), np.uint8)]
    response = enc.vllm034_response("chat", [1, 2], [[3]], rows)
    del response["choices"][0]["token_ids"]
    with pytest.raises(ValueError, match="f:1 choice 0: needs .* return_token_ids: true"):
        vllm_response_documents(response, "f:1")
    response = enc.vllm034_response("chat", [1, 2], [[3]], rows)
    response["choices"][0]["routed_experts"] = None
    with pytest.raises(ValueError, match="choice 0 has no routed_experts .*--enable-return-routed"):
        vllm_response_documents(response, "f:1")
    with pytest.raises(ValueError, match="routed_experts_prompt_start must be a non-negative"):
        vllm_response_documents({**response, "routed_experts_prompt_start": -1}, "f:1")


def test_vllm021_split_form_joins_prompt_and_completion_rows():
    # T = 6 and 5 tokens; the engine captured T - 1 rows of each.
    full = [np.arange(6 * 3 * 2).reshape(6, 3, 2) % 8, np.arange(5 * 3 * 2).reshape(5, 3, 2) % 7]
    response = enc.vllm021_response([1, 2, 3], [[4, 5, 6], [7, 8]], [f[:-1] for f in full])
    docs = vllm_response_documents(response, "f:1")
    assert [d.num_tokens for d in docs] == [6, 5]
    # Choice 1 shares choice 0's prompt rows (one prompt), then its own completion's row.
    assert np.array_equal(docs[0].rows_TLK, full[0][:5])
    assert np.array_equal(docs[1].rows_TLK, np.concatenate([full[0][:3], full[1][3:4]]))
    # An empty completion part is null in 0.21: the prompt's rows alone.
    one = enc.vllm021_response([1, 2], [[3]], [full[0][:2]])
    assert one["choices"][0]["routed_experts"] is None
    assert vllm_response_documents(one, "f:1")[0].rows_TLK.shape == (2, 3, 2)
    short = enc.vllm021_response([1, 2, 3], [[4]], [full[0][:3]])
    short["prompt_routed_experts"] = short["prompt_routed_experts"][:2]
    with pytest.raises(ValueError, match="2 rows for 3 prompt tokens"):
        vllm_response_documents(short, "f:1")


def test_the_row_order_comes_from_the_engine_version():
    """system_fingerprint ``vllm-<version>...`` (vLLM 0.21 ``entrypoints/openai/fingerprint.py``)
    names the version; without one, 0.21's split form is 0.21's; --vllm-moe-rows decides over both."""
    from megatron_ext.replay.vllm_routes import moe_rows_first

    split = {"prompt_routed_experts": None}
    assert moe_rows_first({"system_fingerprint": "vllm-0.21.0-tp2-ep-1a2b3c4d"})
    assert moe_rows_first({"system_fingerprint": "vllm-0.21.1rc2-1a2b3c4d", **split})
    assert not moe_rows_first({"system_fingerprint": "vllm-0.34.0-1a2b3c4d", **split})
    assert not moe_rows_first({"system_fingerprint": "vllm-0.210.0-1a2b3c4d"})
    assert moe_rows_first({"system_fingerprint": None, **split})
    assert not moe_rows_first({"system_fingerprint": "custom-value"})
    assert moe_rows_first({}, "first") and not moe_rows_first(split, "decoder")
