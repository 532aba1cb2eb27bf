"""Tier: pure (numpy). narrow_routes: an engine's ids to the sidecar's dtype, hand-worked."""

import numpy as np
import pytest

from megatron_ext.replay.route_ids import narrow_routes

U8 = np.dtype(np.uint8)


def test_minus_one_rows_become_the_markers_and_ids_narrow() -> None:
    routes = np.array([[[3, 1], [-1, -1]], [[7, 0], [2, 5]]], dtype=np.int64)  # [T=2, L=2, K=2]
    out = narrow_routes(routes, 8, U8)
    assert out.dtype == U8
    assert out.tolist() == [[[3, 1], [255, 255]], [[7, 0], [2, 5]]]


def test_an_input_of_the_sidecar_dtype_keeps_its_markers() -> None:
    routes = np.array([[[255, 255], [4, 6]]], dtype=np.uint8)
    assert narrow_routes(routes, 8, U8).tolist() == routes.tolist()


@pytest.mark.parametrize(
    ("routes", "match"),
    [
        (np.array([[[8, 1]]]), r"route ids must lie in \[0, 8\)"),
        (np.array([[[-2, 1]]]), r"route ids must lie in \[0, 8\)"),
        (np.array([[[-1, 1]]]), r"partly missing"),
        (np.array([[[3, 3]]]), r"repeats an expert"),
        (np.array([[[0.5, 1.0]]]), r"integer expert ids"),
    ],
)
def test_bad_ids_are_refused(routes, match) -> None:
    with pytest.raises(ValueError, match=match):
        narrow_routes(routes, 8, U8)
