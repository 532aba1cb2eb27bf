"""How much of a run's training data has a recorded route, checked when the datasets are built.

A route sidecar may cover its tokens only in part: vLLM's last token of each document has no
route, ``tools/convert_routes.py --reject-invalid-rows`` turns invalid rows into missing ones, a
recording covers only the packs it trained on. ``--replay-missing-route-policy`` decides the
missing rows, so a run over poorly covered data trains on the router's (or a synthetic) routing
while calling it replay. :func:`training_route_coverage` counts, over the real tokens of the packs
the run will train on (from the samples already consumed to the last), the (token, layer) rows
that have no recorded route; :func:`check_route_coverage` logs the fraction and refuses a run
above ``--route-replay-max-missing``. Pads are left out: they copy a token's route (self pads) or
are decided by the policy by design (constant pads).

Example (2 packs of one 3-token document each, 2 MoE layers, one row missing)::

    training_route_coverage(train_dataset, 0, 2)   # (1, 12): 1 of 12 rows has no route

Legend: N real tokens of a pack, L MoE layers, K top-k.
"""

from collections.abc import Iterator
from typing import Any

import numpy as np

from megatron_ext.replay.routes import missing_value


def training_route_coverage(dataset: Any, first: int, end: int) -> tuple[int, int]:
    """``(missing rows, rows)`` over the real tokens of samples ``[first, end)`` of ``dataset``.

    Args:
        dataset: A :class:`~megatron_ext.replay.route_dataset.RoutedPackedDataset`, or Megatron's
            ``BlendedDataset`` of them.
        first: The first sample the run trains on (the samples consumed before a resume).
        end: One past the last (the run's training samples); clipped to the dataset's length.
    """
    missing = rows = 0
    for packs, index in _packs(dataset, first, min(end, len(dataset))):
        cfg = packs.config
        width = cfg.route_num_layers * cfg.route_topk
        source = packs.dataset.sidecars["routes"]
        routes_NLK = packs._gather(source, width, packs.pack_pieces(index)).reshape(
            -1, cfg.route_num_layers, cfg.route_topk
        )
        missing += _count_missing_rows(routes_NLK)
        rows += routes_NLK.shape[0] * cfg.route_num_layers
    return missing, rows


def _count_missing_rows(routes_NLK: np.ndarray) -> int:
    """Missing rows of routes validated when the dataset was built (no row mixes the marker with
    ids, a real row's ids are distinct): a row is missing iff its first two slots hold the marker
    (its only slot at K = 1). Two passes over the buffer instead of K
    (:func:`~megatron_ext.replay.routes.missing_mask`), the cost of this check."""
    marker = missing_value(routes_NLK.dtype)
    missing_NL = routes_NLK[..., 0] == marker
    if routes_NLK.shape[-1] > 1:
        np.logical_and(missing_NL, routes_NLK[..., 1] == marker, out=missing_NL)
    return int(np.count_nonzero(missing_NL))


def _packs(dataset: Any, first: int, end: int) -> Iterator[tuple[Any, int]]:
    """``(packed dataset, its sample index)`` of each sample of ``dataset`` in ``[first, end)``."""
    if not hasattr(dataset, "datasets"):  # a RoutedPackedDataset itself
        yield from ((dataset, i) for i in range(first, end))
        return
    if first >= end:
        return
    if dataset.dataset_index is None:  # Megatron's BlendedDataset loads its indices lazily
        dataset[first]
    which = np.asarray(dataset.dataset_index[first:end])
    index = np.asarray(dataset.dataset_sample_index[first:end])
    for d, i in zip(which.tolist(), index.tolist(), strict=True):
        yield dataset.datasets[d], i


def check_route_coverage(
    dataset: Any, first: int, end: int, max_missing: float, *, log: Any = print
) -> float:
    """Logs the training packs' fraction of rows without a recorded route; refuses a run above
    ``max_missing`` (``--route-replay-max-missing``). Returns the fraction.

    Raises:
        ValueError: More rows than ``max_missing`` allows have no recorded route.
    """
    missing, rows = training_route_coverage(dataset, first, end)
    fraction = missing / rows if rows else 0.0
    log(
        f"> megatron_ext: route replay: {missing} of {rows} (token, layer) rows of the "
        f"{max(end - first, 0)} training packs' real tokens have no recorded route "
        f"({fraction:.2%}; --route-replay-max-missing {max_missing:g})"
    )
    if fraction > max_missing:
        raise ValueError(
            f"--route-replay-max-missing {max_missing:g}: {missing} of {rows} (token, layer) rows "
            f"({fraction:.2%}) of the training data have no recorded route in the "
            "--route-data-suffix sidecars: --replay-missing-route-policy, not the recording, "
            "would decide them. Record or convert routes for this data, or raise the limit"
        )
    return fraction
