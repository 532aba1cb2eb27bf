"""Tier: one gloo rank (the replay benchmark's measurement on a tiny model, two rounds).

What ``measure`` reports besides times is exact: route bytes per token per MoE layer are K = 2
for our uint8 buffer, 8K for Megatron's int64 targets and 4K for its inference buffer (int32);
our binding keeps the uint8 rows on the device, plus a 1-byte mask when missing rows are
possible, and an int64 row index per token. Every variant is timed once per round, and the
checks inside it (each replay routes exactly as recorded) pass.
"""

from megatron_ext.bench.replay_measurements import measure
from megatron_ext.testing import run_distributed


def test_bytes_are_exact_and_every_variant_is_timed_each_round():
    rounds = 2
    (r,) = run_distributed(measure, 1, 2, 8, 2, rounds, 1, timeout=120)
    assert (r["ours_bytes"], r["megatron_bytes"], r["inference_bytes"]) == (2.0, 16.0, 8.0)
    assert r["device_bytes"] == {"ours": 2.0, "ours_unknown": 3.0}
    assert r["index_bytes"] == 8.0
    forward = {"native", "native_again", "megatron", "ours", "ours_unknown", "install"}
    step = {"native", "native_again", "megatron", "megatron_batch", "ours"}
    for times, names in ((r["times"], forward), (r["step_times"], step)):
        assert set(times) == names
        assert all(len(ts) == rounds for ts in times.values()), times
