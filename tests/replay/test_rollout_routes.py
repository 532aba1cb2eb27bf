"""Tier: pure (numpy only). Decoding rollout route dumps and repairing them into route buffers."""

import base64
import json

import numpy as np
import pytest

from megatron_ext.replay.rollout_routes import (
    RepairCounts,
    decode_routed_experts,
    encode_routed_experts,
    read_safetensors,
    repair_document,
    write_safetensors,
)
from megatron_ext.replay.routes import missing_mask
from tests.import_probe import imported_from

KW = {"num_layers": 1, "topk": 2, "num_experts": 8, "name": "req 0"}


def test_docstring_example_rejects_duplicates_and_appends_the_last_row():
    rows = np.array([[[1, 2]], [[4, 4]]])
    routes, counts = repair_document(rows, 3, policy="native", reject_invalid=True, **KW)
    assert routes[0, 0].tolist() == [1, 2]
    assert missing_mask(routes)[:, 0].tolist() == [False, True, True]
    assert (counts.appended_rows, counts.rejected_rows, counts.filled_rows) == (1, 1, 0)


def test_invalid_rows_raise_naming_token_and_layer_unless_rejected():
    rows = np.array([[[1, 2]], [[9, 0]]])
    with pytest.raises(ValueError, match=r"req 0: token 1, MoE layer 0 has experts \[9, 0\]"):
        repair_document(rows, None, policy="native", reject_invalid=False, **KW)
    with pytest.raises(ValueError, match="token 0, MoE layer 0"):
        repair_document(np.array([[[-1, 2]]]), None, policy="native", reject_invalid=False, **KW)


def test_balanced_policy_fills_the_appended_row():
    rows = np.array([[[1, 2]], [[3, 4]]], dtype=np.uint8)
    routes, counts = repair_document(rows, 3, policy="balanced", reject_invalid=False, **KW)
    assert not missing_mask(routes).any() and counts.filled_rows == 1
    assert len(set(routes[2, 0].tolist())) == 2


def test_wrong_shapes_and_counts_are_refused():
    with pytest.raises(ValueError, match="expected 1 MoE layers x top-2"):
        repair_document(
            np.zeros((2, 2, 2), np.int64), None, policy="native", reject_invalid=False, **KW
        )
    with pytest.raises(ValueError, match="2 route rows for 5 tokens"):
        repair_document(
            np.array([[[1, 2]], [[3, 4]]]), 5, policy="native", reject_invalid=False, **KW
        )


def test_single_token_request_has_zero_rows():
    routes, counts = repair_document(np.zeros((0,)), 1, policy="native", reject_invalid=False, **KW)
    assert routes.shape == (1, 1, 2) and missing_mask(routes).all() and counts.appended_rows == 1


def test_base64_round_trip_and_size_check():
    rows = np.random.default_rng(0).integers(0, 300, size=(5, 3, 4)).astype(np.uint16)
    assert np.array_equal(decode_routed_experts(encode_routed_experts(rows)), rows)
    bad = {"data": base64.b64encode(b"\x00" * 7).decode(), "shape": [2, 2, 2], "dtype": "uint8"}
    with pytest.raises(ValueError, match="7 bytes do not hold shape"):
        decode_routed_experts(bad)
    assert np.array_equal(decode_routed_experts(rows.tolist()), rows)


def test_safetensors_round_trip(tmp_path):
    tensors = {
        "doc0": np.arange(12, dtype=np.uint8).reshape(2, 3, 2),
        "doc1": np.arange(8, dtype=np.int32).reshape(1, 2, 4),
    }
    write_safetensors(str(tmp_path / "r.safetensors"), tensors)
    back = read_safetensors(str(tmp_path / "r.safetensors"))
    assert set(back) == set(tensors)
    for key, value in tensors.items():
        assert np.array_equal(back[key], value) and back[key].dtype == value.dtype


def test_counts_add():
    total = RepairCounts()
    total.add(RepairCounts(documents=1, tokens=3, rejected_rows=2))
    total.add(RepairCounts(documents=1, tokens=4, appended_rows=1))
    assert (total.documents, total.tokens, total.rejected_rows, total.appended_rows) == (2, 7, 2, 1)


def test_route_file_and_rollout_modules_never_import_megatron():
    assert (
        imported_from(
            ["megatron_ext.replay.route_file", "megatron_ext.replay.rollout_routes"], ["megatron"]
        )
        == []
    )


def test_route_file_header_round_trip_and_first_invalid_row(tmp_path):
    from megatron_ext.replay.route_file import (
        check_header,
        first_invalid_row,
        header_bytes,
        read_header,
    )

    path = tmp_path / "r.routes.json"
    lengths = np.array([3, 2])
    path.write_bytes(
        header_bytes(num_layers=2, topk=2, num_experts=8, dtype=np.uint8, lengths_D=lengths)
    )
    header = read_header(str(path))
    kw = {"dtype": np.dtype(np.uint8), "num_documents": 2, "num_values": 5 * 2 * 2}
    check_header(header, str(path), num_layers=2, topk=2, num_experts=8, **kw)
    with pytest.raises(ValueError, match="written for 2 MoE layers x top-2 over 8 experts"):
        check_header(header, str(path), num_layers=4, topk=1, num_experts=8, **kw)
    with pytest.raises(ValueError, match="belongs to another file"):
        check_header(
            header, str(path), num_layers=2, topk=2, num_experts=8, **{**kw, "num_values": 4}
        )
    path.write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="is not a megatron_ext.routes header"):
        read_header(str(path))
    stamped = json.loads(
        header_bytes(
            num_layers=2, topk=2, num_experts=8, dtype=np.uint8, lengths_D=lengths, tokens="ab12"
        )
    )
    assert stamped["tokens_digest"] == "ab12"
    path.write_text(json.dumps({**stamped, "tokens_digest": 5}))  # a digest that is no digest
    with pytest.raises(ValueError, match=r"r\.routes\.json: 'tokens_digest' must be a string"):
        read_header(str(path))
    # Hand-worked rows (E = 8, K = 2): token 1 layer 0 duplicates; token 0 layer 1 is missing.
    rows = np.array([[[1, 2], [255, 255]], [[3, 3], [0, 1]]], dtype=np.uint8)
    assert first_invalid_row(rows, 8) == (1, 0, "has duplicate expert ids in its top-k")
    rows[1, 0] = [3, 4]
    assert first_invalid_row(rows, 8) is None
    rows[0, 1] = [255, 1]
    assert first_invalid_row(rows, 8) == (0, 1, "mixes the missing-row marker with real ids")
