"""Tier: pure (numpy). megatron_ext.replay.route_conversion: the flags convert-routes and
ingest-rollouts share, refused when they disagree, and one record converted with its counts (the
tools' round trips: tests/tools/test_convert_routes*.py, test_ingest_rollouts.py)."""

import argparse
import json

import numpy as np
import pytest

from megatron_ext.replay.route_conversion import RouteConverter, add_route_flags


def _args(tmp_path, *argv: str) -> argparse.Namespace:
    (tmp_path / "in.jsonl").write_text("")
    p = argparse.ArgumentParser()
    p.add_argument("--input", action="append", default=[str(tmp_path / "in.jsonl")])
    p.add_argument("--format", default="vllm")
    add_route_flags(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--topk", "2", "--num-experts", "8"], "--num-layers is required"),
        (["--num-layers", "0", "--topk", "2", "--num-experts", "8"], "--num-layers must be >= 1"),
        (["--num-layers", "2", "--topk", "2", "--num-experts", "8", "--vllm-moe-rows", "first"],
         "--vllm-moe-rows first needs the model's decoder layers"),
        (["--format", "sglang", "--num-layers", "2", "--topk", "2", "--num-experts", "8",
          "--vllm-moe-rows", "decoder"], "--vllm-moe-rows decoder applies to --format vllm only"),
        (["--num-decoder-layers", "4"], "--num-decoder-layers needs --moe-layer-ids"),
    ],
)  # fmt: skip
def test_flags_that_disagree_are_refused(tmp_path, argv, match):
    with pytest.raises(ValueError, match=match):
        RouteConverter.from_args(_args(tmp_path, *argv))


def test_a_record_converts_with_its_counts(tmp_path):
    """A vLLM record of 2 decoder layers (layer 0 dense), T = 3: the T - 1 row appended."""
    config = {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4,
              "num_experts_per_tok": 1}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = _args(tmp_path, "--model-config", str(tmp_path / "config.json"))
    converter = RouteConverter.from_args(args)
    assert (args.num_layers, args.topk, args.num_experts) == (1, 1, 4)
    record = {"routed_experts": [[[0], [3]], [[0], [1]]], "token_ids": [7, 8, 9]}
    (tmp_path / "in.jsonl").write_text(json.dumps(record) + "\n")
    [doc] = converter.documents(args.input, "vllm")
    routes = converter.convert(doc, 0, doc.num_tokens)
    assert routes.dtype == np.uint8 and routes[:, 0, 0].tolist() == [3, 1, 255]  # 255: missing
    assert (converter.totals.appended_rows, converter.totals.tokens) == (1, 3)
    assert converter.moe_layer_ids == (1,)
    converter.check_fractions()
    assert "1 T-1 rows appended" in converter.summary()
