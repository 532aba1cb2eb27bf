"""Tier: pure (the replay benchmark's interleaving and paired ratios, on a fake clock).

Interleaved rounds rotate the order of the variants and pair them per round, so a machine that
slows down between rounds (a shared CPU) moves every variant of a round alike and leaves the
paired ratio unchanged; one variant run after another would report the drift as a difference.
"""

import pytest

from megatron_ext.bench.replay import interleaved_rounds, paired_ratio


def test_rounds_rotate_the_order_and_pairs_cancel_drift():
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
    # Warm-up in the given order, then rotated: round 1 starts with the second variant.
    assert order[:3] == ["native", "ours", "slowdown"]
    assert order[3:6] == ["native", "ours", "slowdown"] and order[6:9] == ["ours", "slowdown",
                                                                           "native"]  # fmt: skip
    ratio = paired_ratio(times, "ours", "native")
    # A round where the slowdown falls between the two (ours, slowdown, native) pairs 1.01 with
    # 1.1: 1.01 / 1.1; the other rounds pair equal speeds: 1.01. The median stays 1.01 while the
    # times drift.
    assert ratio["median"] == pytest.approx(1.01)
    assert ratio["min"] == pytest.approx(1.01 / 1.1) and ratio["max"] == pytest.approx(1.01)
    assert max(times["native"]) / min(times["native"]) > 1.5  # the drift was there
