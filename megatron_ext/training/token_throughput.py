"""Tokens per second, real (non-pad) tokens per second and the pad fraction of a log interval.

Megatron's ``--log-throughput`` counts FLOPs of every position, pads included, so a run that pads
half of each pack looks as fast as one that pads nothing (docs/data.md). Example, one interval of 2 s::

    counts = TokenCounts()
    counts.add(tokens=8, pads=3)     # a [2, 4] micro-batch with 3 pads
    counts.add(tokens=8, pads=1)
    rates(counts, seconds=2.0)       # {"tokens_per_s": 8.0, "real_tokens_per_s": 6.0,
                                     #  "pad_fraction": 0.25, "tokens": 16, "real_tokens": 12}
"""

from dataclasses import dataclass

import torch


@dataclass
class TokenCounts:
    """Tokens and real tokens fed to the model since the last log (host ints)."""

    tokens: int = 0
    real_tokens: int = 0

    def add(self, tokens: int, pads: int) -> None:
        """One micro-batch of ``tokens`` positions, ``pads`` of them padding."""
        assert 0 <= pads <= tokens, (pads, tokens)
        self.tokens += int(tokens)
        self.real_tokens += int(tokens) - int(pads)


def micro_batch_counts(host_batch: dict[str, torch.Tensor]) -> tuple[int, int] | None:
    """``(tokens, pads)`` of one host micro-batch; None if it holds no tokens or its pad mask is
    already on the device (counting it there would be a device-to-host sync)."""
    # Read off the host copy before the batch goes to the device: no sync. A batch without
    # padding_mask (Megatron's own datasets) has no pads megatron_ext knows of.
    tokens = host_batch.get("tokens")
    if tokens is None:
        return None
    pad_mask = host_batch.get("padding_mask")
    if pad_mask is None:
        return tokens.numel(), 0
    if pad_mask.device.type != "cpu":
        return None
    return tokens.numel(), int(pad_mask.bool().sum())


def rates(counts: TokenCounts, seconds: float) -> dict[str, float | int]:
    """The interval's record: totals, per second, and the fraction of positions that were pads."""
    assert seconds > 0, seconds
    return {
        "tokens": counts.tokens,
        "real_tokens": counts.real_tokens,
        "tokens_per_s": counts.tokens / seconds,
        "real_tokens_per_s": counts.real_tokens / seconds,
        "pad_fraction": 1 - counts.real_tokens / counts.tokens if counts.tokens else 0.0,
    }


def format_line(record: dict[str, float | int]) -> str:
    """``megatron_ext tokens/s 1234.5 | real tokens/s 617.2 | pad fraction 0.500``."""
    return (
        f"megatron_ext tokens/s {record['tokens_per_s']:.1f} | real tokens/s "
        f"{record['real_tokens_per_s']:.1f} | pad fraction {record['pad_fraction']:.3f}"
    )
