"""Which conversation tokens an SFT sample holds: Megatron's in-order rule and megatron_ext's packing
(pure numpy; never imports megatron).

Megatron's ``SFTDataset`` (megatron-core 0.19.2, ``megatron/training/datasets/sft_dataset.py``) makes
one sample of ``seq_length`` tokens from each JSONL line: the line's conversations in order, each
padded so the running length is a multiple of ``2*CP`` under context parallelism, until one
overflows; that one is cut on the right and every later conversation of the line is dropped; the
rest is one tail pad. :func:`megatron_rule_kept` gives, for every conversation, how many of its
tokens that rule keeps. Worked example (``seq_length`` 8, CP 1, one line of conversations
``[3, 4, 5]``)::

    starts  0 3 7      kept  3 4 1      lost 0 0 4 (= 4 of 12 tokens)
    sample  a a a b b b b c             (no tail pad here)

megatron_ext's packing (:func:`plan_sft_packs`) instead treats each conversation as a document and
packs whole conversations across lines with :mod:`~megatron_ext.data.pack_planning`
(``best_fit`` or ``sequential``), each counted at its length padded to the per-document multiple
(``2*CP``): no conversation is cut unless it is longer than ``seq_length`` on its own
(``--pack-overlong-policy``), so ``split`` loses no token. :func:`packing_stats` counts pads and
lost tokens of either.

Legend: N JSONL lines, Q conversations (all lines' concatenated, line by line), P packs.
"""

import dataclasses

import numpy as np

from megatron_ext.data.pack_planning import (
    OverlongPolicy,
    PackingAlgorithm,
    PackPlan,
    cut_overlong,
    pack_order,
)


def doc_padded_lengths(lens_Q: np.ndarray, doc_multiple: int) -> np.ndarray:
    """Each length rounded up to a multiple of ``doc_multiple`` (>= 1)."""
    if doc_multiple < 1:
        raise ValueError(f"the per-document pad multiple must be >= 1, got {doc_multiple}")
    lens_Q = np.asarray(lens_Q, dtype=np.int64)
    return -(-lens_Q // doc_multiple) * doc_multiple


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
    """Tokens of each conversation that Megatron's ``SFTDataset`` keeps (one sample per line).

    Megatron appends a line's conversations in order, pads the running length to a multiple of
    ``2*CP`` after each, and stops at the first whose end passes ``seq_length``: that one is cut to
    the room left, every later one is dropped. With ``seq_length`` a multiple of the pad multiple,
    a conversation that fits entirely is kept whole, so the kept count is
    ``clip(seq_length - start, 0, length)`` with ``start`` its padded start in the line.

    Args:
        conv_lens_Q: Tokens of each conversation, lines concatenated.
        line_offsets_N1: ``[N + 1]`` offsets of each line's conversations in ``conv_lens_Q``.
        seq_length: Tokens per sample.
        doc_multiple: Megatron's ``2*CP`` under context parallelism, else 1.

    Returns:
        ``[Q]`` int64 kept tokens (0: dropped).

    Raises:
        ValueError: ``seq_length`` not a multiple of ``doc_multiple``, or bad offsets.
    """
    if seq_length < 1 or seq_length % doc_multiple:
        raise ValueError(
            f"--seq-length {seq_length} must be a positive multiple of {doc_multiple} (2*CP)"
        )
    conv_lens_Q = np.asarray(conv_lens_Q, dtype=np.int64)
    offsets = np.asarray(line_offsets_N1, dtype=np.int64)
    if offsets.size < 1 or offsets[0] != 0 or offsets[-1] != conv_lens_Q.size:
        raise ValueError("line offsets must start at 0 and end at the number of conversations")
    padded_Q = doc_padded_lengths(conv_lens_Q, doc_multiple)
    cum_Q1 = np.concatenate([[0], np.cumsum(padded_Q)])
    start_Q = cum_Q1[:-1] - cum_Q1[offsets[:-1]][line_of_conversations(offsets)]
    return np.clip(seq_length - start_Q, 0, conv_lens_Q)


def plan_sft_packs(
    conv_lens_Q: np.ndarray,
    seq_length: int,
    *,
    doc_multiple: int = 1,
    algorithm: PackingAlgorithm = "best_fit",
    window: int = 1000,
    overlong: OverlongPolicy = "split",
) -> PackPlan:
    """Packs whole conversations (in the given order) into packs of ``seq_length`` tokens, each
    counted at its length padded to ``doc_multiple``.

    Over-long conversations are cut by ``overlong`` into pieces of at most ``seq_length`` real
    tokens (a multiple of ``doc_multiple``, so a piece padded still fits); the pieces are then
    planned by ``algorithm`` on their padded lengths.

    Returns:
        The :class:`~megatron_ext.data.pack_planning.PackPlan` (piece arrays hold real lengths).
    """
    if seq_length % doc_multiple:
        raise ValueError(f"--seq-length {seq_length} must be a multiple of {doc_multiple} (2*CP)")
    doc_Q, start_Q, len_Q, counts = cut_overlong(conv_lens_Q, seq_length, overlong)
    order_Q, offsets_P1 = pack_order(
        doc_padded_lengths(len_Q, doc_multiple), seq_length, algorithm, window
    )
    if order_Q is not None:
        doc_Q, start_Q, len_Q = doc_Q[order_Q], start_Q[order_Q], len_Q[order_Q]
    return PackPlan(
        piece_doc_Q=doc_Q,
        piece_start_Q=start_Q,
        piece_len_Q=len_Q,
        pack_offsets_P1=offsets_P1,
        **counts,
    )


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
    """:class:`PackingStats` of a :func:`plan_sft_packs` plan (samples of ``seq_length``)."""
    return packing_stats(conv_lens_Q, plan.piece_len_Q, plan.num_packs, seq_length)
