"""Route sidecar datasets: routes stored beside the token data and packed exactly like it.

A route sidecar is a Megatron ``IndexedDataset`` at ``<data prefix><suffix>`` whose document d
holds ``len(d) * L * K`` uint8/uint16 ids, i.e. ``routes_TLK`` of that document flattened. It
plugs into the data blender's per-token sidecar hook
(:class:`~megatron_ext.data.packed_dataset.Sidecar`), so the packer gathers, splits, truncates
and self-pads routes with the *same* code path as the tokens (one code path; a document whose
route count differs from its token count is refused when the dataset is built). On top of that,
:class:`RoutedPackedDataset` validates each pack's routes (ids, distinct top-k; errors name the
file, pack, token and layer) and applies the missing-route policy. It is built through
``BlendedMegatronDatasetBuilder`` and uses the pack cache like ``PackedDataset``.

:class:`RouteRecorder` is the way back: routes recorded per pack (record mode) are scattered to
their documents through the pack plan and written as a route sidecar aligned with the tokens.

Example::

    config = RoutedPackedDatasetConfig(..., route_suffix="_routes", route_num_layers=2,
                                       route_topk=2, route_num_experts=8)
    train, _, _ = BlendedMegatronDatasetBuilder(RoutedPackedDataset, [100, 0, 0], lambda: True,
                                                config).build()
    train[0]["routes"]   # [S, L, K] uint8; pad positions hold the routes of the tokens they copy

Legend: S positions of a pack, T tokens of a document, L MoE layers, K top-k, Q pack pieces.
"""

import dataclasses
from typing import Any

import numpy as np
import torch

from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.data.packed_dataset import PackedDataset, PackedDatasetConfig, Sidecar
from megatron_ext.replay.routes import (
    apply_missing_policy,
    missing_routes,
    missing_value,
    route_dtype,
    validate_routes,
)

#: Key of the routes in a sample (and of the sidecar in ``PackedDatasetConfig.sidecars``).
ROUTES_KEY = "routes"


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

    def __getitem__(self, idx: int) -> dict[str, Any]:
        sample = super().__getitem__(idx)
        sample["pack_index"] = torch.tensor(idx, dtype=torch.int64)
        cfg = self.config
        if cfg.route_suffix is None:
            return sample
        routes_SLK = sample[ROUTES_KEY].numpy().reshape(-1, cfg.route_num_layers, cfg.route_topk)
        expected = route_dtype(cfg.route_num_experts, cfg.route_topk)
        if routes_SLK.dtype != expected:
            raise ValueError(
                f"route sidecar {self.dataset.path_prefix}{cfg.route_suffix} stores "
                f"{routes_SLK.dtype}, expected {expected} for {cfg.route_num_experts} experts"
            )
        first_token = int(self.plan["piece_start_Q"][self.plan["pack_offsets_P1"][idx]])
        validate_routes(
            routes_SLK,
            num_layers=cfg.route_num_layers,
            num_experts=cfg.route_num_experts,
            topk=cfg.route_topk,
            name=f"{self.dataset.path_prefix}{cfg.route_suffix} pack {idx} "
            f"(first piece starts at document token {first_token}); pack position",
        )
        routes_SLK = apply_missing_policy(  # seed=idx: packs of a micro-batch differ
            routes_SLK, cfg.route_missing_policy, cfg.route_num_experts, seed=idx
        )
        sample[ROUTES_KEY] = torch.from_numpy(np.ascontiguousarray(routes_SLK))
        return sample

    def pack_pieces(self, idx: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(doc_Q, start_Q, len_Q)``: the document pieces pack ``idx`` holds, in order."""
        q0, q1 = (int(v) for v in self.plan["pack_offsets_P1"][idx : idx + 2])
        return (
            self.plan["piece_doc_Q"][q0:q1],
            self.plan["piece_start_Q"][q0:q1],
            self.plan["piece_len_Q"][q0:q1],
        )


class RouteRecorder:
    """Collects routes recorded per pack into per-document buffers; writes a route sidecar.

    Tokens that were never recorded (documents no pack reached, dropped overlong tails) stay
    missing, so a replay routes them natively or by the balanced policy.

    Args:
        doc_lengths: Token count of every document of the token dataset.
        num_layers: L.
        topk: K.
        num_experts: E (selects uint8/uint16).
    """

    def __init__(self, doc_lengths: np.ndarray, num_layers: int, topk: int, num_experts: int):
        self.dtype = route_dtype(num_experts, topk)
        self.docs = [missing_routes(int(n), num_layers, topk, self.dtype) for n in doc_lengths]
        self.recorded_tokens = 0

    @classmethod
    def for_dataset(cls, dataset: RoutedPackedDataset) -> "RouteRecorder":
        """A recorder sized for the documents under ``dataset``."""
        cfg = dataset.config
        lengths = dataset.dataset.tokens.sequence_lengths
        return cls(lengths, cfg.route_num_layers, cfg.route_topk, cfg.route_num_experts)

    def add_pack(
        self, pieces: tuple[np.ndarray, np.ndarray, np.ndarray], routes_SLK: np.ndarray
    ) -> None:
        """Scatters one pack's recorded routes (real positions first, pads after) to documents.

        Args:
            pieces: ``RoutedPackedDataset.pack_pieces(idx)``.
            routes_SLK: The routes the forward chose for that pack (``recorded_routes()[b]``).
        """
        doc_Q, start_Q, len_Q = pieces
        if int(len_Q.sum()) > routes_SLK.shape[0]:
            raise ValueError(
                f"pack holds {int(len_Q.sum())} real tokens but {routes_SLK.shape[0]} routes"
            )
        offset = 0
        for doc, start, length in zip(
            doc_Q.tolist(), start_Q.tolist(), len_Q.tolist(), strict=True
        ):
            self.docs[doc][start : start + length] = routes_SLK[offset : offset + length]
            offset += length
        self.recorded_tokens += offset

    def write(self, path_prefix: str) -> int:
        """Writes ``path_prefix.bin/.idx``; returns the number of documents."""
        return write_documents(path_prefix, self.docs, dtype=self.dtype.type)
