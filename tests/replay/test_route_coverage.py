"""Tier: Megatron on one rank (real IndexedDataset, BlendedMegatronDatasetBuilder, BlendedDataset).

The training packs' missing-route fraction (``--route-replay-max-missing``): counted over the real
tokens of the packs a run trains on, compared with a naive count over the samples themselves.
"""

import os

import numpy as np
import pytest
from megatron.core.datasets.blended_dataset import BlendedDataset

from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.replay.route_coverage import check_route_coverage, training_route_coverage
from megatron_ext.replay.route_dataset import (
    RoutedPackedDataset,
    RoutedPackedDatasetConfig,
    write_route_sidecar,
)
from tests.data.dataset_helpers import build_splits, gpt_config_kwargs
from tests.replay.test_route_dataset import EXPERTS, LAYERS, SEQ, TOPK, corpus, write_routes

__all__ = ["corpus"]  # the fixture: documents whose last token has no route


def _build(root: str, prefixes: list[str], size: int, seq: int = SEQ, weights=None):
    config = RoutedPackedDatasetConfig(
        **gpt_config_kwargs(
            [os.path.join(root, p) for p in prefixes], weights=weights, sequence_length=seq,
            random_seed=3, path_to_cache=os.path.join(root, "cache"),
        ),
        pad_to_seq_len=True, route_num_layers=LAYERS, route_topk=TOPK, route_num_experts=EXPERTS,
    )  # fmt: skip
    return build_splits(RoutedPackedDataset, config, [size, 0, 0])[0]


def _naive(dataset, first: int, end: int) -> tuple[int, int]:
    """Missing rows among the real (not pad) positions of each sample, row by row."""
    missing = rows = 0
    for i in range(first, min(end, len(dataset))):
        sample = dataset[i]
        routes_SLK = sample["routes"].numpy()
        for s in np.flatnonzero(~sample["padding_mask"].numpy()):
            for layer in range(LAYERS):
                rows += 1
                missing += bool((routes_SLK[s, layer] == 255).all())
    return missing, rows


def test_two_packs_of_three_tokens_one_row_missing(tmp_path):
    # Two 3-token documents, packs of 4: one document per pack (3 + 3 > 4), each padded by one.
    # 2 packs x 3 real tokens x 2 layers = 12 rows; document 0's token 1 lacks layer 1's route.
    docs = [np.array([5, 6, 7]), np.array([8, 9, 10])]
    write_documents(str(tmp_path / "d"), docs)
    routes = [np.zeros((3, LAYERS, TOPK), np.uint8) + np.arange(TOPK, dtype=np.uint8)] * 2
    routes[0] = routes[0].copy()
    routes[0][1, 1] = 255
    write_routes(str(tmp_path / "d_routes"), routes)
    dataset = _build(str(tmp_path), ["d"], 2, seq=4)
    assert len(dataset) == 2 and int(dataset[0]["padding_mask"].sum()) == 1
    assert training_route_coverage(dataset, 0, 2) == (1, 12)
    per_pack = sorted(training_route_coverage(dataset, i, i + 1) for i in range(2))
    assert per_pack == [(0, 6), (1, 6)]  # the shuffled order puts either document first
    assert training_route_coverage(dataset, 2, 2) == (0, 0)  # nothing left to train


def test_counts_equal_a_naive_count_over_the_samples(corpus):
    dataset = _build(corpus["root"], ["a"], 40)
    want = _naive(dataset, 0, 40)
    assert want[0] > 0 and want[1] > want[0]  # the documents' last tokens: some rows missing
    assert training_route_coverage(dataset, 0, 40) == want
    assert training_route_coverage(dataset, 7, 10**6) == _naive(dataset, 7, len(dataset))  # resume


def test_a_blend_counts_the_packs_it_draws(corpus):
    blended = _build(corpus["root"], ["a", "b"], 60, weights=[0.3, 0.7])
    assert isinstance(blended, BlendedDataset)
    assert training_route_coverage(blended, 5, 60) == _naive(blended, 5, 60)


def test_the_limit_refuses_more_missing_rows_and_logs_the_fraction(corpus):
    dataset = _build(corpus["root"], ["a"], 40)
    missing, rows = training_route_coverage(dataset, 0, 40)
    logged = []
    fraction = check_route_coverage(dataset, 0, 40, missing / rows, log=logged.append)
    assert fraction == missing / rows
    (line,) = logged
    assert f"{missing} of {rows} (token, layer) rows of the 40 training packs' real tokens" in line
    with pytest.raises(ValueError, match=rf"--route-replay-max-missing 0.01: {missing} of {rows} "):
        check_route_coverage(dataset, 0, 40, 0.01, log=logged.append)


def test_expert_255_of_256_is_a_route_not_a_missing_row(tmp_path):
    # 256 experts, top-2: uint8 ids, where 255 is a real expert; only an all-255 row is missing.
    write_documents(str(tmp_path / "d"), [np.array([5, 6, 7])])
    routes_TLK = np.array([[[255, 3], [0, 1]], [[255, 255], [255, 255]], [[2, 255], [255, 254]]])
    write_route_sidecar(
        str(tmp_path / "d_routes"), [routes_TLK.astype(np.uint8)], num_layers=2, topk=2,
        num_experts=256,
    )  # fmt: skip
    config = RoutedPackedDatasetConfig(
        **gpt_config_kwargs([str(tmp_path / "d")], sequence_length=4, path_to_cache=str(tmp_path)),
        pad_to_seq_len=True, route_num_layers=2, route_topk=2, route_num_experts=256,
    )  # fmt: skip
    dataset = build_splits(RoutedPackedDataset, config, [1, 0, 0])[0]
    assert training_route_coverage(dataset, 0, 1) == (2, 6) == _naive(dataset, 0, 1)


def test_a_second_launch_reads_the_count_and_a_rewritten_route_file_is_counted_again(
    tmp_path, monkeypatch
):
    from megatron_ext.replay import route_coverage

    docs = [np.array([5, 6, 7]), np.array([8, 9, 10])]
    write_documents(str(tmp_path / "d"), docs)
    routes = [np.zeros((3, LAYERS, TOPK), np.uint8) + np.arange(TOPK, dtype=np.uint8)] * 2
    write_routes(str(tmp_path / "d_routes"), routes)
    logged = []
    dataset = _build(str(tmp_path), ["d"], 2, seq=4)
    check_route_coverage(dataset, 0, 2, 0.0, log=logged.append, cache=True)
    assert "0 of 12" in logged[-1] and "earlier launch" not in logged[-1]

    counted = []
    real_count = route_coverage.training_route_coverage
    monkeypatch.setattr(
        route_coverage,
        "training_route_coverage",
        lambda *a: counted.append(a) or real_count(*a),
    )
    again = _build(str(tmp_path), ["d"], 2, seq=4)  # a new launch of the same data
    check_route_coverage(again, 0, 2, 0.0, log=logged.append, cache=True)
    assert counted == [] and "0 of 12" in logged[-1] and "earlier launch" in logged[-1]
    check_route_coverage(again, 1, 2, 0.0, log=logged.append, cache=True)  # a resume
    assert len(counted) == 1 and "0 of 6" in logged[-1]

    # convert-routes writes the sidecar again, now with a missing row: counted, and refused.
    broken = [r.copy() for r in routes]
    broken[0][1, 1] = 255
    for ext in (".idx", ".bin"):
        os.remove(tmp_path / f"d_routes{ext}")
    write_routes(str(tmp_path / "d_routes"), broken)
    rewritten = _build(str(tmp_path), ["d"], 2, seq=4)
    with pytest.raises(ValueError, match="1 of 12"):
        check_route_coverage(rewritten, 0, 2, 0.0, log=logged.append, cache=True)
    assert len(counted) == 2 and "earlier launch" not in logged[-1]


def test_the_key_names_every_component_of_a_blend(corpus):
    from megatron_ext.replay.route_coverage import coverage_key

    blended = _build(corpus["root"], ["a", "b"], 60, weights=[0.3, 0.7])
    key = coverage_key(blended, 5, 60)
    assert blended.unique_description_hash in key
    for packs in blended.datasets:
        assert packs.unique_description_hash in key
        assert os.path.realpath(packs.dataset.sidecars["routes"].path_prefix) in key
    assert coverage_key(blended, 5, 60) == key and coverage_key(blended, 6, 60) != key
