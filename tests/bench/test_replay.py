"""Tier: pure (the registered table built from a fake rank's measurements).

The ``replay`` benchmark runs :func:`~megatron_ext.bench.replay_measurements.measure` in one gloo
rank and turns its bytes and per-round times into rows: each variant's median time and its
median paired ratio (min..max) to native routing and to Megatron's replay. With times whose
ratios are the same in every round, each cell is known exactly.
"""

from megatron_ext.bench import replay as bench
from megatron_ext.bench.replay_measurements import measure


def _fake_rank() -> dict:
    # Two rounds; the second twice as slow (drift): paired ratios are the same in both.
    times = {"native": 1.0, "native_again": 1.0, "megatron": 2.0, "ours": 1.5}
    times |= {"ours_unknown": 3.0, "install": 0.1}
    step = {"native": 0.01, "native_again": 0.01, "megatron": 0.02, "megatron_batch": 0.04}
    step |= {"ours": 0.02}
    return {
        "ours_bytes": 2.0,
        "megatron_bytes": 16.0,
        "inference_bytes": 8.0,
        "device_bytes": {"ours": 2.0, "ours_unknown": 3.0},
        "index_bytes": 8.0,
        "times": {name: [t, 2 * t] for name, t in times.items()},
        "step_times": {name: [t, 2 * t] for name, t in step.items()},
    }


def test_rows_carry_each_variants_bytes_and_paired_ratios(monkeypatch):
    calls = []

    def fake_run_distributed(fn, world_size, *args):
        calls.append((fn, world_size, args))
        return [_fake_rank()]

    monkeypatch.setattr(bench, "run_distributed", fake_run_distributed)
    result = bench.replay(quick=True)
    assert calls == [(measure, 1, (2, 128, 2, 9, 2))]  # batch, seq, layers, rounds, inner
    rows = {row[0]: row[1:] for row in result.rows}
    assert len(rows) == len(result.rows) == 15
    assert rows["native routing (no replay)"] == [
        "-",
        1.5,
        1.0,
        "1.000..1.000",
        0.5,
        "0.500..0.500",
    ]
    assert rows["Megatron RouterReplay (REPLAY_FORWARD)"] == [
        16.0,
        3.0,
        2.0,
        "2.000..2.000",
        1.0,
        "1.000..1.000",
    ]
    ours = "megatron_ext route buffer (uint8, stored/H2D), no missing row (data's host count)"
    assert rows[ours] == [2.0, 2.25, 1.5, "1.500..1.500", 0.75, "0.750..0.750"]
    install = "megatron_ext install() alone (per micro-batch; share of a native forward)"
    assert rows[install] == ["-", 0.15, 0.1, "-", "-", "-"]
    step = [row for name, row in rows.items() if name.startswith("replay step alone")]
    assert [row[1] for row in step] == [0.015, 0.015, 0.03, 0.06, 0.03]  # median per micro-batch
    assert [row[4] for row in step] == [0.5, 0.5, 1.0, 2.0, 1.0]  # vs Megatron's precomputed
    assert "0.500x (0.500..0.500) the fed Megatron step" in result.notes  # ours / users' glue
    assert result.extra["times_ms"] == _fake_rank()["times"]
