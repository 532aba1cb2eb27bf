"""Tier: pure (the registered table's wiring, with the gloo ranks replaced by a fake).

The ``alignment`` benchmark runs :func:`~megatron_ext.bench.alignment_rows.measure_rows` at EP=1
and EP=2 under each allocator setting, each setting in fresh worker processes, and keeps rank 0's
rows (the exchanges keep the ranks in step). This checks what it asks the ranks for, quick and
full, and that the table is rank 0's rows in that order under the measurement's columns.
"""

import pytest

from megatron_ext.bench import alignment as bench
from megatron_ext.bench import alignment_layer
from megatron_ext.bench.alignment_rows import COLUMNS, measure_rows


@pytest.mark.parametrize(
    ("quick", "tokens", "hidden", "rounds"), [(True, [48, 1024], 256, 3), (False, None, 1024, 15)]
)
def test_runs_each_allocator_and_ep_size_and_keeps_rank_zeros_rows(
    monkeypatch, quick, tokens, hidden, rounds
):
    calls, events = [], []

    def fake_run_distributed(fn, world_size, *args, ep, timeout):
        calls.append((fn, world_size, args, ep, timeout))
        events.append("run")
        if fn is alignment_layer.measure_layers:  # the whole-layer table: both allocators at once
            rss = {"glibc": 1.0, "caching": 2.0}
            return [{"rows": [[f"layer rank{r}"] * 10], "peak_rss_mib": rss} for r in range(2)]
        allocator = args[3]
        # One row per rank, each cell naming where it came from.
        return [[[f"{allocator} ep{ep} rank{r}"] * len(COLUMNS)] for r in range(world_size)]

    monkeypatch.setattr(bench, "run_distributed", fake_run_distributed)
    monkeypatch.setattr(bench, "shutdown_pools", lambda: events.append("shutdown"))
    result = bench.alignment(quick)
    tokens = tokens or [48, 1024, 8192]
    layer_call = calls.pop()
    layer_tokens, layer_rounds = ([256], 3) if quick else ([1024, 8192], 9)
    assert layer_call == (
        alignment_layer.measure_layers,
        2,
        (layer_tokens, hidden, layer_rounds),
        1,
        1800,
    )
    assert [(fn, n, ep, timeout) for fn, n, _, ep, timeout in calls] == [
        (measure_rows, ep, ep, 1800) for _ in bench.ALLOCATORS for ep in (1, 2)
    ]
    assert [args for _, _, args, _, _ in calls] == [
        (tokens, hidden, rounds, allocator, not quick)  # whole designs in the full run only
        for allocator in ("glibc", "caching")
        for _ in (1, 2)
    ]
    # Fresh workers before each allocator setting, and none kept after the 'caching' ones.
    assert events == ["shutdown", "run", "run", "shutdown", "run", "run", "shutdown"] + [
        "run",  # the whole-layer table's own 2-rank world, shut down after (one caching rank)
        "shutdown",
    ]
    (layer_table,) = result.tables
    assert layer_table.columns == alignment_layer.COLUMNS
    assert layer_table.rows == [["layer rank0"] * 10]
    assert "glibc 1 MiB, caching 2 MiB" in layer_table.notes
    assert result.columns == COLUMNS
    assert [row[0] for row in result.rows] == [
        "glibc ep1 rank0",
        "glibc ep2 rank0",
        "caching ep1 rank0",
        "caching ep2 rank0",
    ]
    assert f"hidden {hidden}," in result.notes
    # The notes say how many rounds ran: as asked (quick), or rounded up to whole designs.
    assert (f"{rounds} rounds (column" in result.notes) is quick
    assert ("rounded up to whole designs" in result.notes) is not quick
