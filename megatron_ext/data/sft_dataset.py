"""Megatron's ``--sft`` dataset with self pads and megatron_ext's packing (Megatron glue).

:class:`SelfPaddedSFTDataset` subclasses Megatron's ``SFTDataset`` (megatron-core 0.19.2,
``megatron/training/datasets/sft_dataset.py``): the same JSONL, conversations, tokens and prompt
masks, built by Megatron's builder with an ``SFTDatasetConfig``; pads are self pads
(``--pad-policy``) and whole conversations are packed across lines (``--sft-packing packed``).
Samples carry ``PackedDataset``'s keys; docs/data.md lists every difference from Megatron's.
"""

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, Literal

import numpy as np
import torch
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.utils import Split
from megatron.training.datasets.sft_dataset import IGNORE_INDEX, SFTDataset

from megatron_ext.common.safe_files import file_identity, lengths_fingerprint
from megatron_ext.data import pack_index_cache
from megatron_ext.data.config import PaddingConfig
from megatron_ext.data.indexed_checks import (
    add_data_identity,
    check_dataset_config,
    default_cache_dir,
)
from megatron_ext.data.pack_planning import (
    OverlongPolicy,
    PackingAlgorithm,
    plan_packs,
    shuffle_packs,
)
from megatron_ext.data.pad_fill import PadFillFields
from megatron_ext.data.padding import pad_pack
from megatron_ext.data.sft_packing import megatron_rule_kept

logger = logging.getLogger(__name__)

SFTPacking = Literal["packed", "megatron"]
SFT_PACKINGS: tuple[str, ...] = ("packed", "megatron")
_SCAN_KEYS = ("conv_lens_Q", "line_offsets_N1")
_PLAN_KEYS = ("piece_conv_Q", "piece_start_Q", "piece_len_Q", "pack_offsets_P1", "counts")


@dataclasses.dataclass
class SFTDatasetConfig(PadFillFields, GPTDatasetConfig):
    """``GPTDatasetConfig`` (``context_parallel_size`` sets the per-conversation pad multiple
    ``2*CP``) plus what fills pads (constant pads are the tokenizer's pad id, as in Megatron:
    ``pad_constant_id`` is unused) and how samples are packed."""

    sft_packing: SFTPacking = "packed"
    """'packed': whole conversations packed across lines; 'megatron': one line per sample."""
    packing_algorithm: PackingAlgorithm = "best_fit"
    """'sequential' or 'best_fit' (packed only)."""
    packing_window: int = 1000
    """Conversations per best_fit window."""
    pack_overlong_policy: OverlongPolicy = "split"
    """Conversations longer than sequence_length: 'split', 'truncate' or 'drop' (packed only)."""

    def __post_init__(self) -> None:
        check_dataset_config(self)
        super().__post_init__()
        self.check_pad_fill()
        pad = self.tokenizer.pad
        if not isinstance(pad, (int, np.integer)) or pad < 0:
            raise ValueError(
                f"the SFT tokenizer has no pad id ({pad!r}): its --sft-tokenizer-prompt-format "
                "names a pad token its vocabulary lacks"
            )
        if self.sft_packing not in SFT_PACKINGS:
            raise ValueError(
                f"--sft-packing must be one of {SFT_PACKINGS}, got {self.sft_packing!r}"
            )
        plan_packs(  # the packing flags and --seq-length against 2*CP, checked now
            np.zeros(0, dtype=np.int64),
            self.sequence_length,
            doc_multiple=self.doc_multiple,
            algorithm=self.packing_algorithm,
            window=self.packing_window,
            overlong=self.pack_overlong_policy,
        )

    @property
    def doc_multiple(self) -> int:
        """Every conversation's padded length is a multiple of this (Megatron's ``2*CP``)."""
        return PaddingConfig.doc_pad_multiple(self.context_parallel_size or 1)


def tokenizer_identity(tokenizer: Any) -> str:
    """What a conversation's tokens depend on, hashed: the Hugging Face tokenizer's full state and
    the SFT prompt config (format, chat template, masks) of Megatron's ``SFTTokenizer`` wrapper."""
    sft = getattr(tokenizer, "_tokenizer", tokenizer)  # MegatronTokenizer -> SFTTokenizer
    hf = getattr(sft, "_tokenizer", sft)
    backend = getattr(hf, "backend_tokenizer", None)
    # A fast tokenizer's whole tokenizer.json, else its vocabulary.
    state = backend.to_str() if backend is not None else json.dumps(sorted(hf.get_vocab().items()))
    prompt = f"{getattr(sft, '_prompt_format', None)}\n{getattr(sft, '_prompt_config', None)!r}"
    digest = hashlib.blake2b((state + "\n" + prompt).encode("utf-8"), digest_size=16)
    return f"{type(hf).__name__}:{digest.hexdigest()}"


class SelfPaddedSFTDataset(SFTDataset):
    """Megatron's ``SFTDataset`` with self pads and whole-conversation packing."""

    def __init__(
        self,
        dataset: Any,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: SFTDatasetConfig,
    ) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        self.config: SFTDatasetConfig = config
        self.plan: dict[str, np.ndarray] | None = None
        if config.sft_packing == "megatron":  # one line a sample, read when asked: no plan
            return
        scan = self._conversation_lengths()
        self.conv_lens_Q, self.line_offsets_N1 = scan["conv_lens_Q"], scan["line_offsets_N1"]
        # The plan depends on the conversations' lengths: key its cache (and a blend's) by them.
        add_data_identity(
            self,
            lengths_fingerprint(self.conv_lens_Q) + "/" + lengths_fingerprint(self.line_offsets_N1),
        )
        self.plan, self.cache_hit = pack_index_cache.load_or_build(
            self._cache_path(type(self).__name__, self.unique_description_hash, index_split.name),
            self._build_plan,
            self.unique_description,
            _PLAN_KEYS,
        )
        self.stats: dict[str, int] = json.loads(str(self.plan["counts"]))
        if len(self) == 0 and num_samples:
            raise ValueError(
                f"--data-path {dataset_path}: the {index_split.name} split's "
                f"{self.indices.size} lines hold no conversation that fits a pack ({self.stats})"
            )

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return SFTDataset._key_config_attributes() + [
            "sft_packing",
            "packing_algorithm",
            "packing_window",
            "pack_overlong_policy",
            "context_parallel_size",
        ]

    def _cache_path(self, name: str, digest: str, split: str) -> str:
        cache_dir = default_cache_dir(self.config, self.dataset_path or "")
        return pack_index_cache.cache_path(cache_dir, digest, name, split)

    def _conversation_lengths(self) -> dict[str, np.ndarray]:
        """Every line's conversations' token counts (the whole file, all splits)."""
        # One tokenizing pass, cached under the identity of the file and of the tokenizer: an
        # unchanged file is scanned once; another tokenizer or prompt format scans again.
        path = self.dataset_path or ""
        description = (
            f"sft conversation lengths of {os.path.realpath(path)} {file_identity(path)} "
            f"tokenizer {tokenizer_identity(self.config.tokenizer)}"
        )
        digest = hashlib.blake2b(description.encode("utf-8"), digest_size=16).hexdigest()
        arrays, _ = pack_index_cache.load_or_build(
            self._cache_path("SFTConversationLengths", digest, "all"),
            self._scan,
            description,
            _SCAN_KEYS,
        )
        return arrays

    def _scan(self) -> dict[str, np.ndarray]:
        tokenizer = self.config.tokenizer
        hf = self.dataset.dataset  # Megatron's SFTLowLevelDataset holds the `datasets` table
        conv_lens: list[int] = []
        offsets = [0]
        for batch in hf.iter(batch_size=1024):
            for messages in batch["messages"]:
                conversations = self._split_conversations(messages or [])
                if not conversations:
                    raise ValueError(
                        f"--data-path {self.dataset_path} line {len(offsets)}: no messages "
                        "(Megatron's SFTDataset cannot make a sample of it)"
                    )
                for conversation in conversations:
                    tokens = tokenizer.tokenize_conversation(
                        conversation, return_target=False, add_generation_prompt=False
                    )
                    conv_lens.append(len(tokens))
                offsets.append(len(conv_lens))
        logger.info(
            "%s: %d conversations on %d lines", self.dataset_path, len(conv_lens), len(offsets) - 1
        )
        return {
            "conv_lens_Q": np.asarray(conv_lens, dtype=np.int64),
            "line_offsets_N1": np.asarray(offsets, dtype=np.int64),
        }

    def _build_plan(self) -> dict[str, np.ndarray]:
        """Epochs of this split's conversations, shuffled, each planned into packs, until
        ``num_samples`` packs."""
        cfg, offsets = self.config, self.line_offsets_N1
        lines = self.indices.astype(np.int64)
        counts_L = offsets[lines + 1] - offsets[lines]
        first_L = np.cumsum(counts_L) - counts_L
        convs = np.repeat(offsets[lines] - first_L, counts_L) + np.arange(int(counts_L.sum()))
        parts: list[tuple[np.ndarray, ...]] = []
        stats: dict[str, int] = {}
        num_packs, epoch = 0, 0
        target = self.num_samples if self.num_samples is not None else 1
        while num_packs < target or epoch == 0:
            rng = np.random.default_rng((cfg.random_seed, epoch))
            convs_D = rng.permutation(convs)
            plan = plan_packs(
                self.conv_lens_Q[convs_D],
                cfg.sequence_length,
                doc_multiple=cfg.doc_multiple,
                algorithm=cfg.packing_algorithm,
                window=cfg.packing_window,
                overlong=cfg.pack_overlong_policy,
            )
            if epoch == 0:
                stats = {
                    k: getattr(plan, k)
                    for k in ("num_split", "num_truncated", "num_dropped", "num_empty")
                }
            if plan.num_packs == 0:
                break
            # best_fit builds packs longest first: shuffle the pack order too.
            piece_Q, sizes_P = shuffle_packs(
                np.arange(plan.piece_len_Q.size),
                plan.pack_offsets_P1,
                rng.permutation(plan.num_packs),
            )
            parts.append(
                (
                    convs_D[plan.piece_doc_Q[piece_Q]],
                    plan.piece_start_Q[piece_Q],
                    plan.piece_len_Q[piece_Q],
                    sizes_P,
                )
            )
            num_packs += plan.num_packs
            epoch += 1
            if self.num_samples is None:
                break
        empty = np.zeros(0, dtype=np.int64)
        columns = [np.concatenate([p[i] for p in parts]) if parts else empty for i in range(4)]
        return {
            "piece_conv_Q": columns[0],
            "piece_start_Q": columns[1].astype(np.int32),
            "piece_len_Q": columns[2].astype(np.int32),
            "pack_offsets_P1": np.concatenate([[0], np.cumsum(columns[3])]).astype(np.int64),
            "counts": np.array(json.dumps({**stats, "num_epochs": epoch})),
        }

    def __len__(self) -> int:
        if self.plan is not None:
            return int(self.plan["pack_offsets_P1"].size - 1)
        return self.num_samples if self.num_samples is not None else int(self.indices.size)

    def _conversations(self, line: int) -> list[list[dict[str, Any]]]:
        conversations = self._split_conversations(self.dataset[line] or [])
        if not conversations:
            raise ValueError(
                f"--data-path {self.dataset_path} line {line + 1}: no messages "
                "(Megatron's SFTDataset cannot make a sample of it)"
            )
        return conversations

    def _tokenize(self, conversation: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """Megatron's tokens and targets of one conversation (IGNORE_INDEX on prompts)."""
        tokens, targets = self.config.tokenizer.tokenize_conversation(
            conversation, return_target=True, add_generation_prompt=False
        )
        return np.asarray(tokens, dtype=np.int64), np.asarray(targets, dtype=np.int64)

    def _megatron_rule_pieces(self, idx: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The JSONL line of sample ``idx`` (Megatron's index rule) cut by Megatron's rule."""
        # Tokenized in order until one overflows: those after it are never read, as in Megatron.
        line = int(self.indices[idx % len(self.indices)])
        pieces: list[tuple[np.ndarray, np.ndarray]] = []
        lengths: list[int] = []
        for conversation in self._conversations(line):
            tokens, targets = self._tokenize(conversation)
            pieces.append((tokens, targets))
            lengths.append(tokens.size)
            kept = megatron_rule_kept(
                np.asarray(lengths), np.asarray([0, len(lengths)]),
                self.config.sequence_length, self.config.doc_multiple,
            )  # fmt: skip
            if kept[-1] < tokens.size:  # this one overflowed: the rest of the line is dropped
                break
        return [(t[:k], g[:k]) for (t, g), k in zip(pieces, kept.tolist(), strict=True) if k]

    def _packed_pieces(self, idx: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The conversation pieces of pack ``idx`` of the plan."""
        plan, offsets = self.plan, self.line_offsets_N1
        lo, hi = plan["pack_offsets_P1"][idx : idx + 2]
        pieces = []
        for q in range(int(lo), int(hi)):
            conv = int(plan["piece_conv_Q"][q])
            line = int(np.searchsorted(offsets, conv, side="right")) - 1
            tokens, targets = self._tokenize(self._conversations(line)[conv - int(offsets[line])])
            if tokens.size != self.conv_lens_Q[conv]:
                raise ValueError(
                    f"--data-path {self.dataset_path} line {line + 1}: a conversation tokenized to "
                    f"{tokens.size} tokens where the cached scan counted {self.conv_lens_Q[conv]}; "
                    f"delete the caches under {default_cache_dir(self.config, self.dataset_path or '')}"
                )
            start, length = int(plan["piece_start_Q"][q]), int(plan["piece_len_Q"][q])
            pieces.append((tokens[start : start + length], targets[start : start + length]))
        return pieces

    def __getitem__(self, idx: int) -> dict[str, Any]:
        if not 0 <= idx < len(self):
            raise IndexError(f"{type(self).__name__} index {idx} out of range 0..{len(self) - 1}")
        cfg = self.config
        pieces = (
            self._packed_pieces(idx) if self.plan is not None else self._megatron_rule_pieces(idx)
        )
        # Megatron's targets are IGNORE_INDEX on prompt tokens: that is the target mask.
        tokens_N = np.concatenate([t for t, _ in pieces]) if pieces else np.zeros(0, np.int64)
        targets_N = np.concatenate([g for _, g in pieces]) if pieces else np.zeros(0, np.int64)
        pack = pad_pack(
            tokens_N,
            np.asarray([t.size for t, _ in pieces], dtype=np.int64),
            cfg.sequence_length,
            policy=cfg.pad_policy,
            pad_id=cfg.tokenizer.pad,  # Megatron's SFT pad id (its prompt format's)
            placeholder_ids=cfg.multimodal_placeholder_ids,
            target_mask_N=(targets_N != IGNORE_INDEX).astype(np.float32),
            doc_multiple=cfg.doc_multiple,
        )
        return {
            "tokens": torch.from_numpy(pack.tokens_S),
            "labels": torch.from_numpy(pack.labels_S),
            "loss_mask": torch.from_numpy(pack.loss_mask_S),
            "position_ids": torch.from_numpy(pack.position_ids_S),
            "padding_mask": torch.from_numpy(pack.pad_mask_S),
            "src_index": torch.from_numpy(pack.src_index_S),
            "cu_seqlens": torch.from_numpy(pack.cu_seqlens),
            "num_segments": torch.tensor(pack.num_segments, dtype=torch.int32),
            "max_seqlen": torch.tensor(pack.max_seqlen, dtype=torch.int32),
        }
