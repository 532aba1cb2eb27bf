"""Route sidecar datasets: routes stored beside the token data and packed exactly like it.

A route sidecar (``<data prefix><suffix>``, document d holding ``routes_TLK`` flattened) plugs
into the packer's per-token sidecar hook, so routes are split and self-padded by the tokens' own
code path; its header and every row are checked once when the dataset is built (never
mid-training), and samples then only get the missing-route policy::

    config = RoutedPackedDatasetConfig(..., route_suffix="_routes", route_num_layers=2,
                                       route_topk=2, route_num_experts=8)
    train, _, _ = BlendedMegatronDatasetBuilder(RoutedPackedDataset, [100, 0, 0], lambda: True,
                                                config).build()
    train[0]["routes"]   # [S, L, K] uint8; pad positions hold the routes of the tokens they copy
    train[0]["route_missing_rows"]   # (token, layer) rows without a route, counted on the host

Legend: S positions of a pack, T tokens of a document, L MoE layers, K top-k, Q pack pieces.
"""

import dataclasses
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.common.safe_files import check_output_prefix, file_identity
from megatron_ext.data import pack_index_cache
from megatron_ext.data.indexed_checks import (
    CHUNK_VALUES,
    default_cache_dir,
    flat_values,
    locate,
    open_indexed,
)
from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.data.packed_dataset import (
    PackedDataset,
    PackedDatasetConfig,
    PackedLowLevelDataset,
    Sidecar,
)
from megatron_ext.replay.route_file import (
    HEADER_EXTENSION,
    check_header,
    first_invalid_row,
    header_bytes,
    read_header,
    tokens_digest,
)
from megatron_ext.replay.route_recorder import RouteRecorder as RouteRecorder  # re-exported
from megatron_ext.replay.routes import (
    apply_missing_policy,
    count_missing_rows,
    missing_mask,
    missing_routes,
    missing_value,
    route_dtype,
)

#: Key of the routes in a sample (and of the sidecar in ``PackedDatasetConfig.sidecars``).
ROUTES_KEY = "routes"
#: Key of a sample's count of missing (token, layer) route rows, int64, counted on the host when
#: the pack is read; it must stay on the host (see :func:`has_missing_routes`).
MISSING_ROWS_KEY = "route_missing_rows"
#: Key of a sample's ``[S, L]`` bool mask of the rows ``balanced`` filled (no recorded route), with
#: ``RoutedPackedDatasetConfig.route_filled_mask`` (the replay check tells them from recorded rows).
FILLED_KEY = "route_filled"

#: Headers already warned about for lacking a tokens digest (the dataset is built per split).
_WARNED_NO_DIGEST: set[str] = set()


def has_missing_routes(batch: dict[str, Any]) -> bool | None:
    """Whether any route row of a micro-batch is missing, from its host-side counts (None: the
    batch carries none), for ``RouteReplayBinding.install(..., has_missing=...)``."""
    counts = batch.get(MISSING_ROWS_KEY)
    if counts is None:
        return None
    if counts.device.type != "cpu":  # reading them there would be a sync per micro-batch
        raise ValueError(
            f"batch[{MISSING_ROWS_KEY!r}] is on {counts.device}: keep it on the host (reading "
            "it from the device would be a device-to-host sync per micro-batch)"
        )
    return bool(counts.any())


def route_sidecar(suffix: str, num_layers: int, topk: int, num_experts: int) -> Sidecar:
    """The sidecar spec of a route file: width ``L * K``, constant pads get the missing marker."""
    fill = missing_value(route_dtype(num_experts, topk))
    return Sidecar(suffix=suffix, width=num_layers * topk, fill=fill)


@dataclasses.dataclass
class RoutedPackedDatasetConfig(PackedDatasetConfig):
    """``PackedDatasetConfig`` plus a route sidecar (mirrors ``ReplayConfig``'s flags)."""

    route_suffix: str | None = "_routes"
    """Route sidecar at ``<data prefix><route_suffix>`` (--route-data-suffix); None in record
    mode: samples then carry ``pack_index`` but no routes (a :class:`RouteRecorder` fills them)."""
    route_num_layers: int = 1
    """L: MoE layers of the model (MTP excluded)."""
    route_topk: int = 1
    """K: --moe-router-topk."""
    route_num_experts: int = 1
    """E: --num-experts."""
    route_missing_policy: str = "native"
    """--replay-missing-route-policy: 'native' keeps missing rows, 'balanced' fills them."""
    route_filled_mask: bool = False
    """'balanced': samples also carry the mask of the rows it filled (``FILLED_KEY``)."""

    def __post_init__(self) -> None:
        if self.route_suffix is not None:
            self.sidecars = {
                **self.sidecars,
                ROUTES_KEY: route_sidecar(
                    self.route_suffix,
                    self.route_num_layers,
                    self.route_topk,
                    self.route_num_experts,
                ),
            }
        super().__post_init__()
        apply_missing_policy(  # rejects an unknown policy now, with the flag's name
            missing_routes(0, self.route_num_layers, self.route_topk, np.dtype(np.uint8)),
            self.route_missing_policy,
            self.route_num_experts,
        )


class RoutedPackedDataset(PackedDataset):
    """``PackedDataset`` whose samples carry validated ``routes`` ``[S, L, K]`` and ``pack_index``."""

    config: RoutedPackedDatasetConfig

    @staticmethod
    def build_low_level_dataset(
        dataset_path: str, config: RoutedPackedDatasetConfig
    ) -> PackedLowLevelDataset:
        """``PackedDataset``'s, after checking the route file's header, and then every row."""
        if config.route_suffix is None:
            return PackedDataset.build_low_level_dataset(dataset_path, config)
        route_prefix = dataset_path + config.route_suffix
        _check_route_shape(dataset_path, route_prefix, config)
        low = PackedDataset.build_low_level_dataset(dataset_path, config)
        _validate_route_file(low.sidecars[ROUTES_KEY], low.tokens, route_prefix, config)
        return low

    def __getitem__(self, idx: int) -> dict[str, Any]:
        sample = super().__getitem__(idx)
        sample["pack_index"] = torch.tensor(idx, dtype=torch.int64)
        cfg = self.config
        if cfg.route_suffix is None:
            return sample
        # Every row was validated when the dataset was built (_validate_route_file).
        routes_SLK = sample[ROUTES_KEY].numpy().reshape(-1, cfg.route_num_layers, cfg.route_topk)
        if cfg.route_filled_mask and cfg.route_missing_policy == "balanced":
            sample[FILLED_KEY] = torch.from_numpy(missing_mask(routes_SLK))  # before the fill
        routes_SLK = apply_missing_policy(  # seed=idx: packs of a micro-batch differ
            routes_SLK,
            cfg.route_missing_policy,
            cfg.route_num_experts,
            seed=idx,
            src_index_T=sample["src_index"].numpy(),  # a self pad replays its source's fill
        )
        sample[ROUTES_KEY] = torch.from_numpy(np.ascontiguousarray(routes_SLK))
        # balanced leaves no row missing; native: counted here, where the rows are on the host.
        missing = 0 if cfg.route_missing_policy != "native" else count_missing_rows(routes_SLK)
        sample[MISSING_ROWS_KEY] = torch.tensor(missing, dtype=torch.int64)
        return sample


def write_route_sidecar(
    path_prefix: str,
    routes_per_doc: Iterable[np.ndarray],
    *,
    num_layers: int,
    topk: int,
    num_experts: int,
    overwrite: bool = False,
    flag: str = "--route-record-path",
    inputs: tuple[str, ...] = (),
    tokens_prefix: str | None = None,
    moe_layer_ids: Sequence[int] | None = None,
) -> int:
    """Writes route documents ``[T, L, K]`` with the header (L, K, E) beside them, atomically.

    ``routes_per_doc`` may be a generator: documents are written as they come (memory holds
    one), and an exception it raises (even after its last document) leaves nothing written.
    ``tokens_prefix`` and ``moe_layer_ids`` go into the header
    (:func:`~megatron_ext.replay.route_file.header_bytes`).

    ValueError: an existing output without ``overwrite``, an output equal to one of ``inputs``,
    or a route buffer of another shape / dtype.
    """
    dtype = route_dtype(num_experts, topk)
    exts = (".bin", ".idx", HEADER_EXTENSION)
    check_output_prefix(path_prefix, flag=flag, inputs=inputs, overwrite=overwrite, extensions=exts)
    lengths: list[int] = []

    def checked() -> Iterator[np.ndarray]:
        for d, routes in enumerate(routes_per_doc):
            if routes.ndim != 3 or routes.shape[1:] != (num_layers, topk) or routes.dtype != dtype:
                raise ValueError(
                    f"route document {d} is {routes.dtype} {routes.shape}, expected {dtype} "
                    f"[T, {num_layers}, {topk}]"
                )
            lengths.append(routes.shape[0])
            yield routes

    def header() -> bytes:  # called after the last document: made from their lengths
        return header_bytes(
            num_layers=num_layers,
            topk=topk,
            num_experts=num_experts,
            dtype=dtype,
            lengths_D=np.array(lengths, dtype=np.int64),
            tokens=None if tokens_prefix is None else tokens_digest(tokens_prefix),
            moe_layer_ids=moe_layer_ids,
        )

    return write_documents(
        path_prefix, checked(), dtype=dtype.type, companions={HEADER_EXTENSION: header}
    )


def _check_route_shape(
    dataset_path: str, route_prefix: str, config: RoutedPackedDatasetConfig
) -> None:
    """Refuses a route file written for another L / K / E, in those terms (not as "N values")."""
    tokens = open_indexed(dataset_path, "--data-path")
    routes = open_indexed(route_prefix, "routes sidecar")
    header_path = route_prefix + HEADER_EXTENSION
    lens, route_lens = tokens.sequence_lengths, routes.sequence_lengths
    if os.path.isfile(header_path):
        header = read_header(header_path)
        check_header(
            header,
            header_path,
            num_layers=config.route_num_layers,
            topk=config.route_topk,
            num_experts=config.route_num_experts,
            dtype=routes.index.dtype,
            num_documents=int(route_lens.size),
            num_values=int(route_lens.sum()),
        )
        if "tokens_digest" in header:
            _check_tokens_digest(header["tokens_digest"], dataset_path, route_prefix, config)
        elif os.path.realpath(header_path) not in _WARNED_NO_DIGEST:
            _WARNED_NO_DIGEST.add(os.path.realpath(header_path))  # once per file and launch
            warnings.warn(
                f"route file {route_prefix} records no tokens digest (converted without "
                f"--tokens-prefix): routes left beside rewritten tokens of the same lengths "
                f"cannot be caught; convert with tools/convert_routes.py --tokens-prefix "
                f"{dataset_path}",
                stacklevel=2,
            )
    else:
        warnings.warn(
            f"route file {route_prefix} has no header {header_path}: the MoE layer count, top-k "
            "and expert count it was written for cannot be checked (only L x K); rewrite it with "
            "tools/convert_routes.py",
            stacklevel=2,
        )
    width = config.route_num_layers * config.route_topk
    # A constant ratio other than L x K is another model's file: say so in those terms, before
    # the per-document alignment check would name only a document.
    if route_lens.shape == lens.shape and lens.sum() and (route_lens != width * lens).any():
        per_token = route_lens[lens > 0] / lens[lens > 0]
        if (per_token == per_token[0]).all() and float(per_token[0]).is_integer():
            raise ValueError(
                f"route file {route_prefix} holds {int(per_token[0])} expert ids per token, the "
                f"model needs {config.route_num_layers} MoE layers x top-{config.route_topk} = "
                f"{width}: it was written for another number of MoE layers or top-k"
            )
    expected = route_dtype(config.route_num_experts, config.route_topk)
    if routes.index.dtype != expected:
        raise ValueError(
            f"route file {route_prefix} stores {np.dtype(routes.index.dtype).name}, expected "
            f"{expected.name} for {config.route_num_experts} experts and top-{config.route_topk}"
        )


def _check_tokens_digest(
    digest: str, dataset_path: str, route_prefix: str, config: RoutedPackedDatasetConfig
) -> None:
    """Refuses routes written for other token data than ``dataset_path``'s (the token files read
    once per state)."""
    key = (
        f"tokens {digest} {os.path.realpath(dataset_path)} "
        f"{file_identity(dataset_path + '.idx')} {file_identity(dataset_path + '.bin')}"
    )

    def check() -> None:
        if tokens_digest(dataset_path) != digest:
            raise ValueError(
                f"route file {route_prefix} was written for other token data than {dataset_path} "
                "(its header's tokens_digest differs: the tokens were rewritten after the routes "
                "were converted or recorded); convert or record the routes again"
            )

    _once_per_state(config, route_prefix, key, check)


def _once_per_state(
    config: RoutedPackedDatasetConfig, route_prefix: str, key: str, check: Callable[[], None]
) -> None:
    """Runs ``check`` unless it passed before under ``key`` (file identities in it), remembering
    a pass in the index cache directory."""
    cache_dir = default_cache_dir(config, route_prefix)
    if pack_index_cache.validated(cache_dir, key):
        return
    check()
    pack_index_cache.mark_validated(cache_dir, key)


def _validate_route_file(
    routes: IndexedDataset,
    tokens: IndexedDataset,
    route_prefix: str,
    config: RoutedPackedDatasetConfig,
) -> None:
    """Validates every row of the route file once (chunked, vectorized; an unchanged file is read
    once)."""
    num_layers, topk, num_experts = (
        config.route_num_layers,
        config.route_topk,
        config.route_num_experts,
    )
    key = (
        f"routes L={num_layers} K={topk} E={num_experts} {os.path.realpath(route_prefix)} "
        f"{file_identity(route_prefix + '.bin')}"
    )

    def check() -> None:
        rows_TLK = flat_values(routes, route_prefix).reshape(-1, num_layers, topk)
        rows_per_chunk = max(CHUNK_VALUES // (num_layers * topk), 1)
        for start in range(0, rows_TLK.shape[0], rows_per_chunk):
            chunk = np.asarray(rows_TLK[start : start + rows_per_chunk])
            bad = first_invalid_row(chunk, num_experts)
            if bad is not None:
                row, layer, what = bad
                doc, token = locate(tokens.sequence_lengths, start + row)
                raise ValueError(
                    f"route file {route_prefix}: document {doc}, token {token}, MoE layer "
                    f"{layer} {what}"
                )

    _once_per_state(config, route_prefix, key, check)
