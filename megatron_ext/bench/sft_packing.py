"""Benchmark ``sft_packing``: pad fraction, tokens lost and index build time of ``--sft`` samples,
megatron_ext's packing vs Megatron's ``SFTDataset`` rule, at CP 1, 2, 4 and 8.

The conversations are the ``packing`` benchmark's lengths (seq 4096). Megatron's rule (one sample per
JSONL line) depends on how lines hold conversations, so two layouts are measured: one conversation
per line, and lines filled to ``seq_length``.
"""

import statistics
import time

import numpy as np

from megatron_ext.bench.packing import SEQ_LENGTH, sft_like_lengths
from megatron_ext.bench.registry import BenchResult, register_benchmark

CONTEXT_PARALLEL_SIZES = (1, 2, 4, 8)


def filled_lines(lens_Q: np.ndarray, seq_length: int) -> np.ndarray:
    """``[N + 1]`` line offsets: each line takes conversations until one reaches ``seq_length``."""
    # The packing benchmark's stream of conversations, cut where Megatron's rule cuts.
    offsets, total = [0], 0
    for q, n in enumerate(lens_Q.tolist()):
        total += n
        if total >= seq_length:
            offsets.append(q + 1)
            total = 0
    if offsets[-1] != lens_Q.size:
        offsets.append(int(lens_Q.size))
    return np.asarray(offsets, dtype=np.int64)


def _median_seconds(fn, repeats: int) -> tuple[object, float]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return result, statistics.median(times)


@register_benchmark("sft_packing")
def sft_packing(quick: bool) -> BenchResult:
    """Pad fraction, tokens lost and index build time per CP size, ours vs Megatron's SFT rule."""
    from megatron_ext.data import pack_kernel
    from megatron_ext.data.pack_planning import plan_packs
    from megatron_ext.data.sft_packing import megatron_rule_stats, plan_stats

    num_convs = 20_000 if quick else 1_000_000
    repeats = 3 if quick else 5
    lens_Q = sft_like_lengths(num_convs)
    shuffled_Q = lens_Q[np.random.default_rng(1).permutation(num_convs)]
    layouts = {
        "one conversation per line": np.arange(num_convs + 1, dtype=np.int64),
        "lines filled to seq_length": filled_lines(lens_Q, SEQ_LENGTH),
    }
    if pack_kernel.library() is None:  # compile before any timed plan
        raise RuntimeError("the pack kernel did not compile; the figures would be the fallback's")
    rows: list[list] = []
    for cp in CONTEXT_PARALLEL_SIZES:
        # Under CP every conversation is padded to a multiple of 2*CP, Megatron's rule and ours.
        multiple = 2 * cp if cp > 1 else 1
        for layout, offsets in layouts.items():
            # Checked against Megatron's class in tests/data/test_sft_dataset.py. It builds no
            # index (each sample packs its line when read): no build time.
            stats = megatron_rule_stats(lens_Q, offsets, SEQ_LENGTH, multiple)
            rows.append([cp, f"Megatron SFTDataset rule, {layout}", stats.samples,
                         stats.pad_fraction, stats.lost_fraction, "none"])  # fmt: skip
        # As SelfPaddedSFTDataset plans an epoch. The tokenizing scan that gives ours the lengths
        # (once per file and tokenizer, cached) is not timed: it is one pass of the tokenization
        # Megatron's rule does for every sample it reads.
        for algorithm in ("sequential", "best_fit"):
            plan, seconds = _median_seconds(
                lambda a=algorithm, m=multiple: plan_packs(
                    shuffled_Q, SEQ_LENGTH, algorithm=a, doc_multiple=m
                ),
                repeats,
            )
            stats = plan_stats(shuffled_Q, plan, SEQ_LENGTH)
            rows.append([cp, f"ours: --sft-packing packed, {algorithm}", stats.samples,
                         stats.pad_fraction, stats.lost_fraction, seconds])  # fmt: skip
    total = int(lens_Q.sum())
    return BenchResult(
        title=f"SFT packing: Megatron's SFTDataset rule vs ours, CP 1-8 ({num_convs} conversations, "
        f"seq {SEQ_LENGTH})",
        columns=["CP", "method", "samples", "pad fraction", "tokens lost", "index build s"],
        rows=rows,
        notes=_notes(num_convs, total, repeats),
        extra={"num_conversations": num_convs, "tokens": total},
    )


def _notes(num_convs: int, total: int, repeats: int) -> str:
    """How the table was measured and how to read it."""
    return (
        f"{num_convs} conversations with the packing benchmark's lengths (log-normal, median "
        f"~545 tokens, clipped to 8..12288), {total} tokens, one epoch, samples of "
        f"{SEQ_LENGTH} tokens. Under CP every conversation is padded to a multiple of 2*CP "
        "(Megatron's rule and ours alike). Megatron's rule: one sample per JSONL line, the "
        "conversation that overflows cut on the right and the rest of its line dropped; "
        "'lines filled to seq_length' puts conversations on a line until one crosses the "
        "sequence length. Ours: whole conversations packed across lines (best_fit window "
        "1000), over-long ones split into pieces, nothing lost. Pad fraction = pads / sample "
        "tokens (per-conversation and tail pads); tokens lost = conversation tokens in no "
        f"sample / all. Index build s: median of {repeats} plans of the epoch (the pack kernel "
        "loaded); Megatron's rule builds no index. The tokenizing scan that gives ours the "
        "lengths runs once per file and tokenizer (cached) and is not timed."
    )
