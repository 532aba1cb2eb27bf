"""Packed Megatron dataset: whole documents packed into self-padded packs of <= seq_length tokens.

Glue over the pure planning, index and padding modules, built through Megatron's
``BlendedMegatronDatasetBuilder`` like ``GPTDataset`` (so ``--data-path`` blends and splits work;
docs/data.md has an example). A sample holds ``tokens, labels, loss_mask, position_ids,
padding_mask, src_index, cu_seqlens, num_segments, max_seqlen`` (+ ``dataset_id``, sidecars).
"""

import dataclasses
import json
import logging
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split

from megatron_ext.data import pack_index_cache
from megatron_ext.data.empty_split import empty_split_error
from megatron_ext.data.indexed_checks import (
    add_data_identity,
    check_aligned,
    check_dataset_config,
    check_finite,
    check_values,
    data_identity,
    default_cache_dir,
    open_indexed,
)
from megatron_ext.data.pack_index import (
    PACK_INDEX_FORMAT,
    PackIndex,
    PieceSlots,
    smallest_index_dtype,
)
from megatron_ext.data.pack_planning import (
    OverlongPolicy,
    PackingAlgorithm,
    cut_overlong,
    pack_order,
    plan_packs,
    shuffle_packs,
)
from megatron_ext.data.pad_fill import PadFillFields
from megatron_ext.data.padding import (
    check_fill,
    gather_by_src_index,
    pad_pack,
    padded_doc_lengths,
    target_length,
)

logger = logging.getLogger(__name__)

_PLAN_KEYS = ("piece_Q", "pack_offsets_P1", "counts")


@dataclasses.dataclass(frozen=True)
class Sidecar:
    """A per-token IndexedDataset beside the tokens: document d holds ``width * len(d)`` values
    (row-major [len(d), width]) at ``<data prefix><suffix>``; constant pads get ``fill``."""

    suffix: str
    width: int = 1
    fill: int = -1
    finite: bool = False
    """Float values checked finite when the dataset is built (a NaN names file and document)."""


@dataclasses.dataclass
class PackedDatasetConfig(PadFillFields, GPTDatasetConfig):
    """``GPTDatasetConfig`` plus packing and padding, all set from ``PaddingConfig``'s flags.

    ``reset_position_ids`` and ``reset_attention_mask`` are implied (a pack keeps its documents
    apart), and no dense attention mask is built (``gpt_forward_kwargs`` does).
    """

    pad_to_seq_len: bool = False
    """Pad every pack to sequence_length."""
    pad_to_multiple_of: int = 1
    """Otherwise pad each pack to a multiple of this (resolved: user value or derived)."""
    doc_pad_multiple: int = 1
    """Pad every document to a multiple of this inside its pack (2*CP under context
    parallelism); planning counts the padded lengths."""
    packing_algorithm: PackingAlgorithm = "best_fit"
    """'sequential' or 'best_fit'."""
    packing_window: int = 1000
    """Window of documents for best_fit."""
    pack_overlong_policy: OverlongPolicy = "split"
    """'split', 'truncate' or 'drop' documents longer than sequence_length."""
    loss_mask_suffix: str | None = None
    """Per-token loss-mask sidecar (width 1, 1 = train on the token) at prefix + suffix."""
    sidecars: dict[str, Sidecar] = dataclasses.field(default_factory=dict)
    """Extra per-token sidecars, returned under their name padded via ``src_index``."""

    def __post_init__(self) -> None:
        check_dataset_config(self)
        super().__post_init__()
        # Catch bad values at build time with the flag's name, before any index is computed.
        target_length(
            0,
            seq_length=self.sequence_length,
            pad_to_seq_len=self.pad_to_seq_len,
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
        plan_packs(
            np.zeros(0, dtype=np.int64),
            self.sequence_length,
            algorithm=self.packing_algorithm,
            window=self.packing_window,
            overlong=self.pack_overlong_policy,
            doc_multiple=self.doc_pad_multiple,
        )
        self.check_pad_fill()
        for name, sidecar in self.sidecars.items():
            if sidecar.width < 1:
                raise ValueError(f"sidecar {name!r} width must be >= 1, got {sidecar.width}")


@dataclasses.dataclass
class PackedLowLevelDataset:
    """The token IndexedDataset and its aligned sidecars (one sequence = one document)."""

    tokens: IndexedDataset
    loss_mask: IndexedDataset | None
    sidecars: dict[str, IndexedDataset]
    path_prefix: str
    identity: str = ""
    """:func:`~megatron_ext.data.indexed_checks.data_identity` of the tokens (cache key part)."""


class PackedDataset(MegatronDataset):
    """Packs whole documents of an IndexedDataset into self-padded packs (one pack per sample).

    A sidecar (``PackedDatasetConfig.sidecars = {"routes": Sidecar("_routes", width=L * K)}``)
    is split and padded by the same code as the tokens: ``sample["routes"]`` is [S, W].
    """

    def __init__(
        self,
        dataset: PackedLowLevelDataset,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: PackedDatasetConfig,
    ) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        self.config: PackedDatasetConfig = config
        # The plan depends on the document lengths: key the cache (and a blend's) by them too,
        # and by the index layout, so an index of another format is never misread.
        self.unique_identifiers["pack_index_format"] = PACK_INDEX_FORMAT
        add_data_identity(self, dataset.identity or data_identity(dataset.tokens))
        self._slots = PieceSlots.of(
            dataset.tokens.sequence_lengths,
            config.sequence_length,
            split=config.pack_overlong_policy == "split",
        )
        arrays, self.cache_hit = pack_index_cache.load_or_build(
            self._cache_path(), self._build_plan, self.unique_description, _PLAN_KEYS
        )
        # Pieces of every pack; plan.pack_pieces(p) decodes one pack (see pack_index).
        self.plan = PackIndex(arrays["piece_Q"], arrays["pack_offsets_P1"], self._slots)
        counts = json.loads(str(arrays["counts"]))
        self.stats: dict[str, int] = counts
        if len(self) == 0 and num_samples and not counts["num_dropped"]:
            # No token in the split (no document, or only empty ones): samples asked of it.
            raise empty_split_error(
                dataset_path,
                index_split,
                num_samples,
                self.numel_low_level_dataset(dataset),
                config,
                documents_in_split=int(self.indices.size),
            )
        # Documents there, but every one dropped or empty: 0 packs would only fail later.
        if len(self) == 0 and self.indices.size and num_samples != 0:
            raise ValueError(
                f"--data-path {dataset_path}: none of the {self.indices.size} documents of the "
                f"{index_split.name} split fit a pack ({counts['num_dropped']} longer than "
                f"--seq-length {config.sequence_length} dropped by --pack-overlong-policy drop, "
                f"{counts['num_empty']} empty)"
            )
        if counts["num_split"] or counts["num_truncated"] or counts["num_dropped"]:
            logger.info("%s %s over-long documents: %s", dataset_path, index_split.name, counts)
        self._check_plan()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: PackedLowLevelDataset) -> int:
        return int(low_level_dataset.tokens.sequence_lengths.shape[0])

    @staticmethod
    def build_low_level_dataset(
        dataset_path: str, config: PackedDatasetConfig
    ) -> PackedLowLevelDataset:
        tokens = open_indexed(dataset_path, "--data-path")
        loss_mask = None
        if config.loss_mask_suffix is not None:
            path = dataset_path + config.loss_mask_suffix
            loss_mask = open_indexed(path, "loss-mask sidecar")
            check_aligned(tokens, loss_mask, 1, path)
            # 0/1 only: other values would silently become loss weights.
            cache_dir = default_cache_dir(config, dataset_path)
            check_values(loss_mask, path, (0, 1), "loss-mask sidecar", cache_dir)
        sidecars = {}
        for name, spec in config.sidecars.items():
            path = dataset_path + spec.suffix
            sidecars[name] = open_indexed(path, f"{name} sidecar")
            check_aligned(tokens, sidecars[name], spec.width, path)
            # Refuse a fill the sidecar cannot hold now, not at the first constant pad.
            check_fill(spec.fill, sidecars[name].index.dtype, f"sidecar {name!r} ({path})")
            if spec.finite:
                cache_dir = default_cache_dir(config, dataset_path)
                check_finite(sidecars[name], path, f"{name} sidecar", cache_dir)
        identity = data_identity(tokens)
        return PackedLowLevelDataset(tokens, loss_mask, sidecars, dataset_path, identity)

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return MegatronDataset._key_config_attributes() + [
            "packing_algorithm",
            "packing_window",
            "pack_overlong_policy",
            "doc_pad_multiple",  # planning counts the padded lengths
        ]

    def _cache_path(self) -> str | None:
        return pack_index_cache.cache_path(
            default_cache_dir(self.config, self.dataset.path_prefix),
            self.unique_description_hash,
            type(self).__name__,
            self.index_split.name,
        )

    def _build_plan(self) -> dict[str, np.ndarray]:
        """Epochs of shuffled documents, each planned into packs, until num_samples packs."""
        doc_lens_all = self.dataset.tokens.sequence_lengths
        cfg = self.config
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        counts = {"num_split": 0, "num_truncated": 0, "num_dropped": 0, "num_empty": 0}
        num_packs, epoch = 0, 0
        target = self.num_samples if self.num_samples is not None else 1
        while num_packs < target or epoch == 0:
            # Pure numpy seeded by (seed, epoch): every rank and run plans the same packs.
            rng = np.random.default_rng((cfg.random_seed, epoch))
            docs_D = rng.permutation(self.indices.astype(np.int64))
            # plan_packs' steps, with the pieces encoded once and gathered once into pack order.
            doc_Q, start_Q, len_Q, epoch_counts = cut_overlong(
                doc_lens_all[docs_D],
                cfg.sequence_length,
                cfg.pack_overlong_policy,
            )
            order_Q, offsets_P1 = pack_order(
                padded_doc_lengths(len_Q, cfg.doc_pad_multiple),
                cfg.sequence_length,
                cfg.packing_algorithm,
                cfg.packing_window,
            )
            del len_Q  # (peak build memory: drop each per-piece array once it has been used)
            epoch_packs = offsets_P1.size - 1
            if epoch == 0:  # per pass over the split's documents (later epochs repeat it)
                counts = epoch_counts
            if epoch_packs == 0:
                break  # nothing to pack (empty split): more epochs cannot help
            slot_Q = self._slots.encode(docs_D[doc_Q], start_Q)
            del doc_Q, start_Q
            sizes = np.diff(offsets_P1)
            if order_Q is not None:  # best_fit: undo the longest-first order of packs
                order_P = rng.permutation(epoch_packs)
                slot_Q, sizes = shuffle_packs(slot_Q[order_Q], offsets_P1, order_P)
            parts.append((slot_Q, sizes))
            num_packs += epoch_packs
            epoch += 1
            if self.num_samples is None:
                break
        if not parts:
            parts.append((self._slots.encode(np.zeros(0, np.int64), np.zeros(0, np.int64)),) * 2)
        piece_Q = parts[0][0] if len(parts) == 1 else np.concatenate([p[0] for p in parts])
        offsets_P1 = np.zeros(num_packs + 1, dtype=smallest_index_dtype(piece_Q.size))
        np.cumsum(np.concatenate([p[1] for p in parts]), out=offsets_P1[1:])
        return {
            "piece_Q": piece_Q,
            "pack_offsets_P1": offsets_P1,
            "counts": np.array(json.dumps({**counts, "num_epochs": epoch})),
        }

    def _check_plan(self) -> None:
        problem = self.plan.problem()
        if problem is not None:
            raise ValueError(
                f"pack-index cache {self._cache_path()} is inconsistent ({problem}); delete it"
            )

    def __len__(self) -> int:
        return self.plan.num_packs

    def pack_pieces(self, idx: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(doc_Q, start_Q, len_Q)``: the document pieces pack ``idx`` holds, in order."""
        doc_Q, start_Q, len_Q = self.plan.pack_pieces(idx)
        if len_Q.size and len_Q.min() < 1:  # a slot of an empty document: not this data's index
            raise ValueError(
                f"pack-index cache {self._cache_path()} is inconsistent (pack {idx} holds an "
                "empty piece); delete it"
            )
        return doc_Q, start_Q, len_Q

    @staticmethod
    def _gather(source: IndexedDataset, width: int, pieces: tuple[np.ndarray, ...]) -> np.ndarray:
        # Document d of a sidecar holds [len(d), W] flattened: piece (start, len) is read at
        # start * W, len * W values, so tokens and sidecars are split alike.
        parts = [
            source.get(int(d), offset=int(s) * width, length=int(n) * width)
            for d, s, n in zip(*pieces, strict=True)
        ]
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return flat.reshape(-1, width) if width > 1 else flat

    def __getitem__(self, idx: int) -> dict[str, Any]:
        if not 0 <= idx < len(self):
            raise IndexError(f"PackedDataset index {idx} out of range 0..{len(self) - 1}")
        cfg = self.config
        pieces = self.pack_pieces(idx)
        tokens_N = self._gather(self.dataset.tokens, 1, pieces).astype(np.int64)
        target_mask_N = None
        if self.dataset.loss_mask is not None:
            target_mask_N = self._gather(self.dataset.loss_mask, 1, pieces)
        length = target_length(
            int(padded_doc_lengths(pieces[2], cfg.doc_pad_multiple).sum()),
            seq_length=cfg.sequence_length,
            pad_to_seq_len=cfg.pad_to_seq_len,
            pad_to_multiple_of=cfg.pad_to_multiple_of,
        )
        pack = pad_pack(
            tokens_N,
            pieces[2],
            length,
            policy=cfg.pad_policy,
            pad_id=cfg.pad_constant_id,
            placeholder_ids=cfg.multimodal_placeholder_ids,
            target_mask_N=target_mask_N,
            doc_multiple=cfg.doc_pad_multiple,
        )
        # cu_seqlens at a fixed length across samples (seq_length + 1) so default_collate works.
        cu_seqlens = np.full(cfg.sequence_length + 1, length, dtype=np.int32)
        cu_seqlens[: pack.cu_seqlens.size] = pack.cu_seqlens
        loss_mask_S = pack.loss_mask_S
        if cfg.eod_mask_loss:  # Megatron's rule: no loss where the input token is the eod
            loss_mask_S = np.where(pack.tokens_S == cfg.tokenizer.eod, 0, loss_mask_S)
            loss_mask_S = loss_mask_S.astype(pack.loss_mask_S.dtype)
        sample: dict[str, Any] = {
            "tokens": torch.from_numpy(pack.tokens_S),
            "labels": torch.from_numpy(pack.labels_S),
            "loss_mask": torch.from_numpy(loss_mask_S),
            "position_ids": torch.from_numpy(pack.position_ids_S),
            "padding_mask": torch.from_numpy(pack.pad_mask_S),
            "src_index": torch.from_numpy(pack.src_index_S),
            "cu_seqlens": torch.from_numpy(cu_seqlens),
            "num_segments": torch.tensor(pack.num_segments, dtype=torch.int32),
            "max_seqlen": torch.tensor(pack.max_seqlen, dtype=torch.int32),
        }
        for name, source in self.dataset.sidecars.items():  # padded as the tokens: src_index
            spec = cfg.sidecars[name]
            values = self._gather(source, spec.width, pieces)
            sample[name] = torch.from_numpy(
                gather_by_src_index(values, pack.src_index_S, spec.fill)
            )
        return sample
