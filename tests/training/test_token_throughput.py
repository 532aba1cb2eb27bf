"""Tier: pure (host tensors). The interval counts behind tokens/s, real tokens/s and the pad fraction."""

import pytest
import torch

from megatron_ext.training.token_throughput import (
    TokenCounts,
    format_line,
    micro_batch_counts,
    rates,
)


def test_hand_worked_interval() -> None:
    # Two [2, 4] micro-batches: pads at 3 and at 1 positions -> 16 tokens, 12 real, 2 s.
    first = {
        "tokens": torch.zeros(2, 4),
        "padding_mask": torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]]),
    }
    second = {
        "tokens": torch.zeros(2, 4),
        "padding_mask": torch.tensor([[0, 0, 0, 0], [0, 0, 0, 1]]),
    }
    counts = TokenCounts()
    for batch in (first, second):
        counts.add(*micro_batch_counts(batch))
    record = rates(counts, seconds=2.0)
    assert record == {
        "tokens": 16,
        "real_tokens": 12,
        "tokens_per_s": 8.0,
        "real_tokens_per_s": 6.0,
        "pad_fraction": 0.25,
    }
    assert format_line(record) == (
        "megatron_ext tokens/s 8.0 | real tokens/s 6.0 | pad fraction 0.250"
    )


def test_edge_cases() -> None:
    assert rates(TokenCounts(), 1.0)["pad_fraction"] == 0.0  # an empty interval
    assert micro_batch_counts({}) is None  # a later pipeline stage holds no tokens
    assert micro_batch_counts({"tokens": torch.zeros(1, 5)}) == (5, 0)  # no pad mask: no pads
    all_pads = {"tokens": torch.zeros(1, 3), "padding_mask": torch.ones(1, 3, dtype=torch.bool)}
    assert micro_batch_counts(all_pads) == (3, 3)
    with pytest.raises(AssertionError):
        TokenCounts().add(tokens=2, pads=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a device mask")
def test_a_device_mask_is_not_read() -> None:
    batch = {"tokens": torch.zeros(1, 4), "padding_mask": torch.ones(1, 4, device="cuda")}
    assert micro_batch_counts(batch) is None
