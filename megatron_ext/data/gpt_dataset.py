"""Self-padded ``GPTDataset``: a drop-in subclass whose short samples get self-token padding.

Megatron pads a short sample with its pad id, then zeroes every token equal to it and masks every
label equal to it: every pad shares one embedding (in an MoE model, one set of experts), and a real
eos equal to the pad id is lost too. Here pads are the sample's own tokens, cycled, and tokens,
labels and loss mask come from positions; index, cache and blending stay Megatron's. Text
``[a b c]``, sequence_length 5::

    Megatron:   tokens [a b c 0 0]   labels [b c 0 0 0]   loss_mask [1 1 0 0 0]
    this class: tokens [a b c a b]   labels [b c a b c]   loss_mask [1 1 0 0 0]  padding_mask
                                                                   [F F F T T]
"""

import dataclasses
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    _get_ltor_masks_and_position_ids,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.object_storage_utils import is_object_storage_path

from megatron_ext.data.empty_split import empty_split_error
from megatron_ext.data.gpt_index_cache import build_indices_whole
from megatron_ext.data.indexed_checks import (
    add_data_identity,
    check_dataset_config,
    data_identity,
    open_indexed,
)
from megatron_ext.data.pad_fill import PadFillFields
from megatron_ext.data.padding import pad_pack


@dataclasses.dataclass
class SelfPaddedGPTDatasetConfig(PadFillFields, GPTDatasetConfig):
    """``GPTDatasetConfig`` plus what fills the pads (:class:`PadFillFields`, set from
    ``PaddingConfig``'s flags)."""

    def __post_init__(self) -> None:
        check_dataset_config(self)
        super().__post_init__()
        self.check_pad_fill()


def _segment_bounds(document_lengths: list[int], num_real: int, seq_length: int) -> np.ndarray:
    """``cu_seqlens`` of the input positions: documents clipped to the ``num_real`` real inputs,
    then one pad segment.

    Example: documents [3, 4] of a full sample with the extra label token, seq_length 6 ->
    [0, 3, 6]; a short sample of documents [2] (num_real 2), seq_length 5 -> [0, 2, 5].
    """
    ends = np.minimum(np.cumsum(np.asarray(document_lengths, dtype=np.int64)), num_real)
    bounds = np.unique(np.concatenate([[0], ends[ends > 0]]))
    if num_real < seq_length:
        bounds = np.concatenate([bounds, [seq_length]])
    return bounds


def document_lengths_from_index(dataset: GPTDataset, idx: int) -> list[int]:
    """The number of tokens sample ``idx`` reads from each of its documents, off ``dataset``'s
    loaded indices (megatron-core 0.19.2 returns them, 0.18.2 does not).

    Example: sample spanning documents of 7 and 5 tokens from offset 5 to offset 2, extra token
    -> [2, 3].
    """
    # As _query_document_sample_shuffle_indices reads them (0.18.2 and 0.19.2 alike): the first
    # document from its start offset, the last up to its end offset plus the extra label token.
    shuffled = dataset.shuffle_index[idx]
    (first, start), (last, end) = dataset.sample_index[shuffled], dataset.sample_index[shuffled + 1]
    extra = int(dataset.config.add_extra_token_to_sequence)
    if first == last:
        return [int(end - start) + extra]
    documents = dataset.document_index[first:last]
    lengths = dataset.dataset.sequence_lengths[documents].astype(np.int64)
    lengths[0] -= start
    return [*map(int, lengths), int(end) + extra]


class SelfPaddedGPTDataset(GPTDataset):
    """``GPTDataset`` with self-token padding of short samples and a ``padding_mask``.

    Each sample is read once and built from positions: no state is carried between calls.
    """

    config: SelfPaddedGPTDatasetConfig

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        """Megatron's IndexedDataset, opened after checking the ``.bin`` against its ``.idx``."""
        if not config.mock and not is_object_storage_path(dataset_path):
            open_indexed(dataset_path, "--data-path")
        return GPTDataset.build_low_level_dataset(dataset_path, config)

    def _build_document_sample_shuffle_indices(self) -> tuple[np.ndarray, ...]:
        # Megatron keys its index cache by the flags only; the sample index depends on the
        # document lengths, so rewritten data at the same prefix must not reuse it.
        add_data_identity(self, data_identity(self.dataset))
        # Its cache files are renamed into place whole (a full disk leaves no partial file).
        return build_indices_whole(self, super()._build_document_sample_shuffle_indices)

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        # Megatron's loop adds epochs until they hold the samples asked for (plus its extra label
        # token): with no token in the split it never ends. Refuse a split that cannot give what
        # is asked; one that nothing is asked of builds empty.
        if num_tokens_per_epoch == 0 and self.num_samples is not None:
            if self.num_samples > 0:
                raise empty_split_error(
                    self.dataset_path,
                    self.index_split,
                    self.num_samples,
                    int(self.dataset.sequence_lengths.shape[0]),
                    self.config,
                    documents_in_split=int(self.indices.size),
                )
            return 1
        return super()._get_num_epochs(num_tokens_per_epoch)

    def _text_and_document_lengths(self, idx: int) -> tuple[np.ndarray, list[int]]:
        """Megatron's text of sample ``idx`` (padded with its pad id) and the number of tokens
        read from each document (megatron-core 0.18.2 returns no lengths: read off the index)."""
        found = self._query_document_sample_shuffle_indices(idx)
        if len(found) == 3:
            return found[0], found[2]
        return found[0], document_lengths_from_index(self, idx)

    def __getitem__(self, idx: int | None) -> dict[str, Any]:
        cfg = self.config
        seq_length = cfg.sequence_length
        extra = int(cfg.add_extra_token_to_sequence)
        # idx None: Megatron's batch-padding sample: sample 0's content (self-padded, so not one
        # constant-id run), every position a pad, loss mask all 0.
        text, document_lengths = self._text_and_document_lengths(0 if idx is None else idx)
        num_text = int(sum(document_lengths))  # real text tokens; the rest is Megatron's pad id
        # Content: the real text, its pad slots refilled by the pad policy (one segment: GPT
        # labels cross document boundaries).
        content = pad_pack(
            text[:num_text],
            np.array([num_text] if num_text else [], dtype=np.int64),
            text.size,
            policy=cfg.pad_policy,
            pad_id=cfg.pad_constant_id,
            placeholder_ids=cfg.multimodal_placeholder_ids,
        ).tokens_S
        num_real = 0 if idx is None else num_text
        # Megatron's layout: inputs are content[:S], labels content[1:S+1] (its extra label token).
        tokens = torch.from_numpy(content[:seq_length].copy())
        if extra:
            labels = torch.from_numpy(content[1 : seq_length + 1].copy())
        else:
            # The last input has no next text token: Megatron writes its pad there (mapped to 0).
            labels = torch.from_numpy(np.append(content[1:], 0))

        attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
            tokens,
            cfg.tokenizer.eod,
            cfg.reset_position_ids,
            cfg.reset_attention_mask,
            cfg.eod_mask_loss,  # Megatron's semantics kept: inputs equal to eod are not trained
            cfg.create_attention_mask,
        )
        # By position: input i is real iff i < num_real; its label text[i + 1] iff i + 1 < num_real.
        loss_mask[max(num_real - 1, 0) :] = 0.0
        padding_mask = torch.zeros(seq_length, dtype=torch.bool)
        padding_mask[min(num_real, seq_length) :] = True

        sample: dict[str, Any] = {"tokens": tokens, "labels": labels}
        # Pads get their own segment (positions restart) so no real token attends to them.
        if getattr(cfg, "inter_document_masking", False):  # a field from megatron-core 0.19 on
            bounds = _segment_bounds(document_lengths, min(num_real, seq_length), seq_length)
            seg_lens = np.diff(bounds)
            position_ids = torch.from_numpy(
                np.arange(seq_length, dtype=np.int64) - np.repeat(bounds[:-1], seg_lens)
            )
            cu_seqlens = torch.full((seq_length + 1,), seq_length, dtype=torch.int32)
            cu_seqlens[: bounds.size] = torch.from_numpy(bounds.astype(np.int32))
            sample["cu_seqlens"] = cu_seqlens
            sample["max_seqlen"] = torch.tensor(int(seg_lens.max()), dtype=torch.int32)
        elif cfg.create_attention_mask:
            sample["attention_mask"] = attention_mask
        sample.update(loss_mask=loss_mask, position_ids=position_ids, padding_mask=padding_mask)
        return sample
