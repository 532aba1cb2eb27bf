"""How much of a run's training data has a recorded route, checked when the datasets are built.

The missing-route policy decides rows without a route (vLLM's last token per document, rows
``--reject-invalid-rows`` rejected, packs a recording did not cover): a poorly covered run would
train on the router's (or a synthetic) routing while calling it replay. The (token, layer) rows of
the real tokens of the packs the run will train on are counted, and a run above
``--route-replay-max-missing`` is refused (pads left out: they copy a token's route or are the
policy's by design). 2 packs of one 3-token document each, 2 MoE layers, one row missing::

    training_route_coverage(train_dataset, 0, 2)   # (1, 12): 1 of 12 rows has no route

Legend: N real tokens of a pack, L MoE layers, K top-k.
"""

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from megatron_ext.common.safe_files import file_identity
from megatron_ext.replay.routes import missing_value


def training_route_coverage(dataset: Any, first: int, end: int) -> tuple[int, int]:
    """``(missing rows, rows)`` over the real tokens of samples ``[first, end)`` of ``dataset``.

    ``dataset``: a ``RoutedPackedDataset`` or Megatron's ``BlendedDataset`` of them; ``first``:
    the samples consumed before a resume; ``end`` is clipped to the dataset's length.
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
    """Missing rows of routes validated when the dataset was built."""
    # Validated rows never mix the marker with ids and a real row's ids are distinct: a row is
    # missing iff its first two slots hold the marker (its only slot at K = 1). Two passes over
    # the buffer instead of missing_mask's K: the cost of this check.
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


def _components(dataset: Any) -> list[Any]:
    return list(dataset.datasets) if hasattr(dataset, "datasets") else [dataset]


def coverage_key(dataset: Any, first: int, end: int) -> str:
    """What the count over samples ``[first, end)`` of ``dataset`` depends on, as one line: the
    blend's and each component's ``unique_description_hash`` (which packs, in which order) and
    the identity of each component's token and route files (their contents)."""
    parts = [f"route-coverage {first} {end} {getattr(dataset, 'unique_description_hash', '-')}"]
    for packs in _components(dataset):
        routes = packs.dataset.sidecars["routes"].path_prefix
        files = [packs.dataset.path_prefix, routes]
        identities = [
            file_identity(f"{prefix}{ext}") for prefix in files for ext in (".idx", ".bin")
        ]
        parts.append(
            f"{packs.unique_description_hash} {os.path.realpath(routes)} {' '.join(identities)}"
        )
    return " | ".join(parts)


def cached_route_coverage(dataset: Any, first: int, end: int) -> tuple[tuple[int, int], bool]:
    """:func:`training_route_coverage`, kept under :func:`coverage_key` in the cache directory of
    the first component's pack plan (``--data-cache-path``, else ``cache/`` beside its data).

    Returns ``((missing rows, rows), whether it came from the cache)``.
    """
    from megatron_ext.data import pack_index_cache
    from megatron_ext.data.indexed_checks import default_cache_dir

    packs = _components(dataset)[0]
    cache_dir = default_cache_dir(packs.config, packs.dataset.path_prefix)
    key = coverage_key(dataset, first, end)
    stored = pack_index_cache.recall_ints(cache_dir, key, 2)
    if stored is not None:
        return (stored[0], stored[1]), True
    counted = training_route_coverage(dataset, first, end)
    pack_index_cache.remember_ints(cache_dir, key, counted)
    return counted, False


def check_route_coverage(
    dataset: Any,
    first: int,
    end: int,
    max_missing: float,
    *,
    log: Any = print,
    cache: bool = False,
) -> float:
    """Logs the training packs' fraction of rows without a recorded route and returns it; a
    fraction above ``max_missing`` (``--route-replay-max-missing``) is a ValueError.

    ``cache``: keep the count in the data cache (the log line says when it was read there).
    """
    if cache:
        (missing, rows), cached = cached_route_coverage(dataset, first, end)
    else:
        (missing, rows), cached = training_route_coverage(dataset, first, end), False
    fraction = missing / rows if rows else 0.0
    log(
        f"> megatron_ext: route replay: {missing} of {rows} (token, layer) rows of the "
        f"{max(end - first, 0)} training packs' real tokens have no recorded route "
        f"({fraction:.2%}; --route-replay-max-missing {max_missing:g})"
        + (" [counted at an earlier launch of the same data]" if cached else "")
    )
    if fraction > max_missing:
        raise ValueError(
            f"--route-replay-max-missing {max_missing:g}: {missing} of {rows} (token, layer) rows "
            f"({fraction:.2%}) of the training data have no recorded route in the "
            "--route-data-suffix sidecars: --replay-missing-route-policy, not the recording, "
            "would decide them. Record or convert routes for this data, or raise the limit"
        )
    return fraction
