"""Tier: pure (numpy). megatron_ext.replay.moe_layer_map: the MoE layers of Hugging Face configs
by the rules vLLM 0.34's model code builds its layers with (models/deepseek_v2.py,
models/qwen3_moe.py), and selecting MoE rows from per-decoder-layer dumps (that the module never
imports megatron is tested with the other pure modules in test_routes.py)."""

import json

import numpy as np
import pytest

from megatron_ext.replay.moe_layer_map import (
    MoeLayerMap,
    moe_layer_ids_from_config,
    parse_layer_ids,
    read_model_config,
    select_moe_rows,
)


def test_parse_layer_ids():
    assert parse_layer_ids("3-5,7") == (3, 4, 5, 7)
    assert parse_layer_ids("0") == (0,)
    for bad, match in (("3,2", "increasing"), ("1,1", "increasing"), ("a", "not an integer")):
        with pytest.raises(ValueError, match=f"--moe-layer-ids .*{match}"):
            parse_layer_ids(bad)


@pytest.mark.parametrize(
    "config, ids",
    [
        # DeepSeek-V3: 61 layers, the first 3 dense
        ({"num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256}, range(3, 61)),
        # moe_layer_freq 2 from layer 1: 2, 4
        ({"num_hidden_layers": 6, "first_k_dense_replace": 1, "moe_layer_freq": 2,
          "n_routed_experts": 8}, [2, 4]),
        # n_routed_experts None: a dense DeepSeek
        ({"num_hidden_layers": 4, "first_k_dense_replace": 0, "n_routed_experts": None}, []),
        # Qwen: (i + 1) % step == 0, minus mlp_only_layers
        ({"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}, [1, 5]),
        ({"num_hidden_layers": 4, "mlp_only_layers": [0]}, [1, 2, 3]),
        # Nemotron-H style block types
        ({"num_hidden_layers": 4, "layers_block_type": ["mamba", "moe", "attention", "moe"]}, [1, 3]),
        ({"num_hidden_layers": 3, "num_local_experts": 8}, [0, 1, 2]),  # Mixtral
    ],
)  # fmt: skip
def test_moe_layers_of_configs(config, ids):
    assert moe_layer_ids_from_config(config, "c") == tuple(ids)


def test_block_types_of_another_length_than_the_layers_are_refused():
    for blocks in (["moe"] * 3, ["moe"] * 5):  # fewer, more: neither says what the engines dump
        with pytest.raises(ValueError, match=rf"^c: 'layers_block_type' lists {len(blocks)} "
                           r"layers, 'num_hidden_layers' is 4$"):  # fmt: skip
            moe_layer_ids_from_config({"num_hidden_layers": 4, "layers_block_type": blocks}, "c")


def test_read_model_config(tmp_path):
    path = tmp_path / "config.json"
    text = {"num_hidden_layers": 4, "first_k_dense_replace": 1, "n_routed_experts": 64,
            "num_experts_per_tok": 6}  # fmt: skip
    path.write_text(json.dumps({"architectures": ["X"], "text_config": text}))  # multimodal
    assert read_model_config(str(path)) == MoeLayerMap(4, (1, 2, 3), topk=6, num_experts=64)
    path.write_text(json.dumps({"num_hidden_layers": 2, "first_k_dense_replace": 2,
                                "n_routed_experts": 8, "num_experts_per_tok": 2}))  # fmt: skip
    with pytest.raises(ValueError, match="--model-config .*describes no MoE layer"):
        read_model_config(str(path))
    path.write_text(json.dumps({"num_hidden_layers": 2, "num_experts": 8}))
    with pytest.raises(ValueError, match="no positive integer top-k"):
        read_model_config(str(path))
    path.write_text("{")
    with pytest.raises(ValueError, match="not a readable JSON config"):
        read_model_config(str(path))


def test_select_moe_rows_checks_dense_rows_are_zero():
    layer_map = MoeLayerMap(4, (1, 3))
    rows = np.zeros((3, 4, 2), dtype=np.int32)
    rows[:, 1] = [[1, 2], [3, 4], [5, 6]]
    rows[:, 3] = [[7, 0], [0, 7], [2, 1]]
    got = select_moe_rows(rows, layer_map, "r:1")
    assert got.tolist() == [[[1, 2], [7, 0]], [[3, 4], [0, 7]], [[5, 6], [2, 1]]]
    assert select_moe_rows(got, layer_map, "r:1") is got  # already MoE rows (vLLM 0.21)
    rows[2, 2] = [0, 3]
    with pytest.raises(ValueError, match=r"r:1: token 2, decoder layer 2 is dense .* \[0, 3\]"):
        select_moe_rows(rows, layer_map, "r:1")
    with pytest.raises(ValueError, match="rows of 5 layers, neither the 2 MoE layers or the .* 4"):
        select_moe_rows(np.zeros((1, 5, 2), dtype=np.int32), layer_map, "r:1")


def test_select_moe_rows_of_vllm021_takes_the_moe_rows_first():
    """vLLM 0.21 (rows by FusedMoE.moe_layer_id): the 3 MoE rows of decoder layers 2-4 first,
    then the 2 rows its _count_moe_layers over-counted, zero. Worked example of the module doc."""
    layer_map = MoeLayerMap(5, (2, 3, 4))
    rows = np.array([[[3, 7], [1, 2], [6, 0], [0, 0], [0, 0]]])
    want = [[[3, 7], [1, 2], [6, 0]]]
    assert select_moe_rows(rows, layer_map, "x", moe_rows_first=True).tolist() == want
    with pytest.raises(ValueError, match=r"x: token 0, decoder layer 0 is dense .* or the dump is "
                       r"vLLM 0.21's.* pass --vllm-moe-rows first"):  # fmt: skip
        select_moe_rows(rows, layer_map, "x")
    rows[0, 4] = [5, 1]
    with pytest.raises(ValueError, match=r"x: token 0, row 4 holds experts \[5, 1\], but a vLLM "
                       r"0.21 dump of this model has its 3 MoE rows first"):  # fmt: skip
        select_moe_rows(rows, layer_map, "x", moe_rows_first=True)
