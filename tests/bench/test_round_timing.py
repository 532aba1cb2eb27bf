"""Tier: pure (interleaved rounds and paired ratios on a fake clock: the replay benchmark's timing).

Interleaved rounds order the variants so each follows every other equally often (a Williams
design, megatron_ext.bench.rounds) and pair them per round, so a machine that
slows down between rounds (a shared CPU) moves every variant of a round alike and leaves the
paired ratio unchanged; one variant run after another would report the drift as a difference.
"""

import pytest

from megatron_ext.bench.round_timing import interleaved_rounds, paired_ratio


def test_rounds_balance_the_order_and_pairs_cancel_drift():
    now, order, speed = [0.0], [], [1.0]

    def variant(name: str, cost: float):
        def run():
            order.append(name)
            now[0] += cost * speed[0]

        return run

    def clock() -> float:
        return now[0]

    variants = {"native": variant("native", 1.0), "ours": variant("ours", 1.01)}

    def slowing_down():  # every call of a round: the machine gets 10 % slower per round
        speed[0] *= 1.1

    variants["slowdown"] = lambda: (order.append("slowdown"), slowing_down())
    times = interleaved_rounds(variants, rounds=6, clock=clock)
    # Warm-up in the given order, then the design's rows (3 variants: 6 rows, the last 3
    # mirrored): round 1 starts with the second variant, round 3 is round 0 reversed.
    assert order[:3] == ["native", "ours", "slowdown"]
    rounds = [order[3 + 3 * r : 6 + 3 * r] for r in range(6)]
    assert rounds[0] == ["native", "ours", "slowdown"] and rounds[1] == [
        "ours",
        "slowdown",
        "native",
    ]
    assert rounds[3] == rounds[0][::-1]
    ratio = paired_ratio(times, "ours", "native")
    # A round where the slowdown falls between the two pairs 1.01 with 1.1: (ours, slowdown,
    # native) gives 1.01 / 1.1 and (native, slowdown, ours) 1.01 * 1.1; the other four rounds
    # pair equal speeds: 1.01. The median stays 1.01 while the times drift.
    assert ratio["median"] == pytest.approx(1.01)
    assert ratio["min"] == pytest.approx(1.01 / 1.1) and ratio["max"] == pytest.approx(1.01 * 1.1)
    assert max(times["native"]) / min(times["native"]) > 1.5  # the drift was there
