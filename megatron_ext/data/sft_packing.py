"""Which conversation tokens an SFT sample holds: Megatron's in-order rule and megatron_ext's packing
(pure numpy; never imports megatron).

Megatron's ``SFTDataset`` (megatron-core 0.19.2, ``megatron/training/datasets/sft_dataset.py``)
fills one sample per JSONL line, cutting the conversation that overflows and dropping the rest of
the line; megatron_ext packs whole conversations across lines (``plan_packs``) and loses none.
``seq_length`` 8, CP 1, one line of conversations ``[3, 4, 5]`` under Megatron's rule::

    starts  0 3 7      kept  3 4 1      lost 0 0 4 (= 4 of 12 tokens)
    sample  a a a b b b b c             (no tail pad here)

Legend: N JSONL lines, Q conversations (all lines' concatenated, line by line), P packs.
"""

import dataclasses

import numpy as np

from megatron_ext.data.pack_planning import PackPlan
from megatron_ext.data.padding import padded_doc_lengths


def line_of_conversations(line_offsets_N1: np.ndarray) -> np.ndarray:
    """``[Q]`` the line each conversation comes from."""
    counts_N = np.diff(np.asarray(line_offsets_N1, dtype=np.int64))
    return np.repeat(np.arange(counts_N.size, dtype=np.int64), counts_N)


def megatron_rule_kept(
    conv_lens_Q: np.ndarray,
    line_offsets_N1: np.ndarray,
    seq_length: int,
    doc_multiple: int = 1,
) -> np.ndarray:
    """``[Q]`` int64: the tokens of each conversation Megatron's ``SFTDataset`` keeps (0: dropped).

    Args:
        conv_lens_Q: Tokens of each conversation, lines concatenated.
        line_offsets_N1: ``[N + 1]`` offsets of each line's conversations in ``conv_lens_Q``.
        seq_length: Tokens per sample (a multiple of ``doc_multiple``).
        doc_multiple: Megatron's ``2*CP`` under context parallelism, else 1.
    """
    if seq_length < 1 or seq_length % doc_multiple:
        raise ValueError(
            f"--seq-length {seq_length} must be a positive multiple of {doc_multiple} (2*CP)"
        )
    conv_lens_Q = np.asarray(conv_lens_Q, dtype=np.int64)
    offsets = np.asarray(line_offsets_N1, dtype=np.int64)
    if offsets.size < 1 or offsets[0] != 0 or offsets[-1] != conv_lens_Q.size:
        raise ValueError("line offsets must start at 0 and end at the number of conversations")
    # Megatron appends a line's conversations, padding the running length to 2*CP after each, and
    # cuts the first whose end passes seq_length to the room left, dropping every later one. With
    # seq_length a multiple of 2*CP a conversation that fits is kept whole: the kept count is
    # clip(seq_length - start, 0, length), start its padded start in the line.
    padded_Q = padded_doc_lengths(conv_lens_Q, doc_multiple)
    cum_Q1 = np.concatenate([[0], np.cumsum(padded_Q)])
    start_Q = cum_Q1[:-1] - cum_Q1[offsets[:-1]][line_of_conversations(offsets)]
    return np.clip(seq_length - start_Q, 0, conv_lens_Q)


@dataclasses.dataclass(frozen=True)
class PackingStats:
    """What a packing rule makes of a set of conversations."""

    samples: int
    """Samples (packs) of ``seq_length`` tokens."""
    tokens: int
    """Conversation tokens in the input."""
    kept: int
    """Conversation tokens in the samples."""
    pads: int
    """Pad tokens in the samples (per-document and tail pads)."""

    @property
    def lost(self) -> int:
        return self.tokens - self.kept

    @property
    def lost_fraction(self) -> float:
        return self.lost / self.tokens if self.tokens else 0.0

    @property
    def pad_fraction(self) -> float:
        total = self.kept + self.pads
        return self.pads / total if total else 0.0


def packing_stats(
    conv_lens_Q: np.ndarray, kept_Q: np.ndarray, samples: int, seq_length: int
) -> PackingStats:
    """Counts of a rule that put ``kept_Q`` tokens of each conversation into ``samples`` samples."""
    kept = int(np.asarray(kept_Q, dtype=np.int64).sum())
    return PackingStats(
        samples=samples,
        tokens=int(np.asarray(conv_lens_Q, dtype=np.int64).sum()),
        kept=kept,
        pads=samples * seq_length - kept,
    )


def megatron_rule_stats(
    conv_lens_Q: np.ndarray, line_offsets_N1: np.ndarray, seq_length: int, doc_multiple: int = 1
) -> PackingStats:
    """:class:`PackingStats` of Megatron's rule (one sample per line)."""
    kept_Q = megatron_rule_kept(conv_lens_Q, line_offsets_N1, seq_length, doc_multiple)
    return packing_stats(conv_lens_Q, kept_Q, len(line_offsets_N1) - 1, seq_length)


def plan_stats(conv_lens_Q: np.ndarray, plan: PackPlan, seq_length: int) -> PackingStats:
    """:class:`PackingStats` of a ``plan_packs`` plan of conversations (samples of ``seq_length``)."""
    return packing_stats(conv_lens_Q, plan.piece_len_Q, plan.num_packs, seq_length)
