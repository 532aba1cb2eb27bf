"""Self-padded ``GPTDataset``: a drop-in subclass whose short samples get self-token padding.

Megatron's ``GPTDataset`` pads a short sample (the last one of an epoch/split when
``drop_last_partial_validation_sequence`` is off) with the pad id and then maps it to token 0,
so every pad shares one embedding and, in a MoE model, one set of experts. This subclass fills
those positions through :func:`megatron_ext.data.padding.pad_pack` instead (the sample's own
tokens, cycled), masks the loss by position (never by comparing ids) and adds ``padding_mask``
(True = pad) for Megatron's MoE router. Everything else -- index building, caching, blending via
``BlendedMegatronDatasetBuilder`` and ``--data-path`` weights -- is Megatron's own::

    config = SelfPaddedGPTDatasetConfig(random_seed=1, sequence_length=64, blend=(prefixes,
                                        weights), split="98,1,1", tokenizer=tok, ...)
    train, valid, test = BlendedMegatronDatasetBuilder(
        SelfPaddedGPTDataset, [1000, 10, 10], lambda: True, config).build()

Example: text ``[a b c]`` (3 real tokens, sequence_length 5, so 6 text slots)::

    Megatron:   tokens [a b c 0 0]   labels [b c 0 0 0]   loss_mask [1 1 0 0 0]
    this class: tokens [a b c a b]   labels [b c a b c]   loss_mask [1 1 0 0 0]  padding_mask
                                                                   [F F F T T]
"""

import dataclasses
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_ext.data.packed_dataset import check_dataset_config
from megatron_ext.data.padding import pad_pack


@dataclasses.dataclass
class SelfPaddedGPTDatasetConfig(GPTDatasetConfig):
    """``GPTDatasetConfig`` plus the pad policy (mirrors ``PaddingConfig``'s flags)."""

    pad_policy: str = "self"
    """'self' or 'constant'."""
    pad_constant_id: int = 0
    """Id of constant pads."""
    multimodal_placeholder_ids: list[int] = dataclasses.field(default_factory=list)
    """Samples containing one of these pad with pad_constant_id."""

    def __post_init__(self) -> None:
        check_dataset_config(self)
        super().__post_init__()
        pad_pack(
            np.zeros(0, np.int64), np.zeros(0, np.int64), 0, policy=self.pad_policy
        )  # type: ignore[arg-type]


class SelfPaddedGPTDataset(GPTDataset):
    """``GPTDataset`` with self-token padding of short samples and a ``padding_mask``.

    Padding happens where Megatron's does (``_query_document_sample_shuffle_indices``); the
    number of real text tokens of the sample last read is kept for ``__getitem__`` to mask by
    position (one sample at a time per dataset object, as in Megatron's own loaders).
    """

    config: SelfPaddedGPTDatasetConfig

    def _query_document_sample_shuffle_indices(
        self, idx: int
    ) -> tuple[np.ndarray, np.ndarray, list]:
        text, document_ids, document_lengths = (
            super()._query_document_sample_shuffle_indices(idx)
        )
        num_real = int(sum(document_lengths))
        self._num_real_text = num_real
        if num_real < text.size:
            # The whole sample is one segment here: Megatron's GPT labels cross documents.
            pack = pad_pack(
                text[:num_real],
                np.array([num_real] if num_real else [], dtype=np.int64),
                text.size,
                policy=self.config.pad_policy,  # type: ignore[arg-type]
                pad_id=self.config.pad_constant_id,
                placeholder_ids=self.config.multimodal_placeholder_ids,
            )
            text = pack.tokens_S
        return text, document_ids, document_lengths

    def __getitem__(self, idx: int | None) -> dict[str, Any]:
        sample = super().__getitem__(idx)
        num_real = self._num_real_text
        seq_length = sample["tokens"].numel()
        # Input position i is real iff i < num_real; its label (text[i + 1]) iff i + 1 < num_real.
        sample["loss_mask"][max(num_real - 1, 0) :] = 0.0
        padding_mask = torch.zeros(seq_length, dtype=torch.bool)
        padding_mask[num_real:] = True
        sample["padding_mask"] = padding_mask
        if self.config.inter_document_masking and num_real < seq_length:
            # Megatron folds the pad into the last document; give pads their own segment.
            cu = sample["cu_seqlens"]
            j = int(torch.searchsorted(cu, torch.tensor(seq_length, dtype=cu.dtype)))
            cu[j] = num_real
            cu[j + 1] = seq_length
            sample["position_ids"][num_real:] = torch.arange(seq_length - num_real)
            sample["max_seqlen"] = (cu[1 : j + 2] - cu[: j + 1]).max()
        return sample
