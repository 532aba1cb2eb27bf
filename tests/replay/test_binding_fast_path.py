"""Tier: gloo ranks (real Megatron GPTModel on CPU, one rank) and Megatron on one rank (datasets).

The replay fast path: a micro-batch whose host-side count says it has no missing route
row is installed with ``has_missing=False``; its routers then skip the missing mask, the native
top-k and the ``where`` (counted: one ``torch.topk`` call fewer per router) and produce bitwise the same outputs
and gradients as the masked path. A micro-batch with missing rows still takes the router's choice
there. Neither path syncs. The dataset counts missing rows per pack on the host, and packs with
and without missing rows both occur.
"""

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_ext.testing import run_distributed
from tests.replay.replay_model import (
    BATCH,
    SEQ,
    batch,
    capture_maps,
    expected_maps,
    loss,
    record,
    tiny_replay_model,
)


class _CountTopK(TorchFunctionMode):
    """Counts ``torch.topk`` calls (the router's native top-k) inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.topk
        return func(*args, **(kwargs or {}))


def _run(model, binding, routes, tokens, positions, has_missing):
    """One training micro-batch: (topk calls, routing maps, loss, router grads)."""
    model.zero_grad(set_to_none=True)
    log, handles = capture_maps(model)
    with _CountTopK() as spy:
        binding.install(routes, key=0, has_missing=has_missing)
        out = loss(model, tokens, positions)
        out.backward()
    for h in handles:
        h.remove()
    binding.clear()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return spy.calls, log, out.detach(), grads


def _fast_and_masked_paths() -> dict:
    from megatron_ext.replay.binding import RouteReplayBinding
    from megatron_ext.testing import count_host_syncs

    torch.manual_seed(7)
    model = tiny_replay_model(False)
    tokens, positions = batch(5)
    routes = record(model, tokens, positions)  # complete: no row missing
    with torch.no_grad():  # the replayed routes are not what the model would choose now
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    binding = RouteReplayBinding(model, "replay", missing_route_policy="native")
    want = expected_maps(binding, routes)
    fast = _run(model, binding, routes, tokens, positions, has_missing=False)
    masked = _run(model, binding, routes, tokens, positions, has_missing=None)
    with_missing = routes.clone()
    with_missing[:, 1::2] = 255  # odd positions missing: the router decides them
    told = _run(model, binding, with_missing, tokens, positions, has_missing=True)
    routers = len(binding.replays)

    def install_and_route(routes_BSLK, has_missing):
        binding.install(routes_BSLK, key="sync", has_missing=has_missing)
        scores = torch.randn(binding._my_positions(BATCH, SEQ).numel(), 8)
        return binding.route(
            binding.replays[0], scores, 2, None, None, lambda s, k, g, gk: torch.topk(s, k, dim=1)
        )

    syncs = {
        name: count_host_syncs(install_and_route, r, h)[1]
        for name, r, h in (("fast", routes, False), ("masked", with_missing, True))
    }
    # The first micro-batch of a shape copies the row index to the device: no sync there either.
    first = RouteReplayBinding(model, "replay", missing_route_policy="native")
    assert first.device_bytes() == (0, 0)  # a new binding: nothing installed or cached yet
    _, syncs["first_of_shape"] = count_host_syncs(
        first.install, routes, key="first", has_missing=False
    )
    # Held on the device: the uint8 rows [L, N, K] (no missing mask) and an int64 row index.
    held = {"bytes": first.device_bytes(), "expected": (routes.numel(), 8 * BATCH * SEQ)}
    first.remove()
    errors = []
    try:
        binding.install(routes, key=1, has_missing=torch.tensor(False))
    except ValueError as exc:
        errors.append(str(exc))
    replayed = binding._my_positions(BATCH, SEQ) % 2 == 0  # router rows of even positions
    binding.remove()
    return {
        "held": held,
        "routers": routers,
        "topk_calls": {"fast": fast[0], "masked": masked[0], "told": told[0]},
        "fast_exact": all(torch.equal(fast[1][n][0], want[n]) for n in want),
        "bitwise": torch.equal(fast[2], masked[2])
        and all(torch.equal(a, b) for a, b in zip(fast[3], masked[3], strict=True))
        and all(torch.equal(fast[1][n][0], masked[1][n][0]) for n in want),
        "told_replayed_exact": all(
            torch.equal(told[1][n][0][replayed], want[n][replayed]) for n in want
        ),
        "told_native_rows_differ": any(
            not torch.equal(told[1][n][0][~replayed], want[n][~replayed]) for n in want
        ),
        "syncs": syncs,
        "errors": errors,
    }


def test_no_missing_row_skips_native_topk_bitwise_and_without_sync():
    (r,) = run_distributed(_fast_and_masked_paths, 1)
    # The fast path was taken: one native top-k fewer per router (Megatron's aux-loss scores
    # call torch.topk once per router on every path).
    calls = r["topk_calls"]
    assert calls["masked"] == calls["told"] == calls["fast"] + r["routers"]
    assert r["routers"] == 2
    assert r["fast_exact"] and r["bitwise"]
    # With missing rows the replayed rows are exact and the native rows are the router's own
    # (non-vacuous: they differ from the routes that were replaced by the marker).
    assert r["told_replayed_exact"] and r["told_native_rows_differ"]
    assert r["syncs"] == {"fast": [], "masked": [], "first_of_shape": []}
    assert r["held"]["bytes"] == r["held"]["expected"], r["held"]
    assert "host bool or None" in r["errors"][0]


def test_dataset_counts_missing_rows_on_the_host(tmp_path):
    from torch.utils.data import default_collate

    from megatron_ext.data.indexed_writer import write_documents
    from megatron_ext.replay.route_dataset import (
        MISSING_ROWS_KEY,
        RoutedPackedDataset,
        RoutedPackedDatasetConfig,
        has_missing_routes,
        write_route_sidecar,
    )
    from megatron_ext.replay.routes import missing_mask
    from tests.data.dataset_helpers import build_splits, gpt_config_kwargs

    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 100, size=int(n)) for n in rng.integers(20, 40, size=16)]
    routes = []
    for d, doc in enumerate(docs):
        r = np.stack([(doc[:, None] + np.arange(2)) % 8] * 2, axis=1).astype(np.uint8)
        if d % 4 == 3:
            r[-1] = 255  # a vLLM-style document: its last token has no route
        routes.append(r)
    write_documents(str(tmp_path / "docs"), docs)
    write_route_sidecar(str(tmp_path / "docs_routes"), routes, num_layers=2, topk=2, num_experts=8)
    kwargs = gpt_config_kwargs(
        [str(tmp_path / "docs")], sequence_length=32, path_to_cache=str(tmp_path / "cache")
    )
    kwargs.update(pad_to_seq_len=True, route_num_layers=2, route_topk=2, route_num_experts=8)
    ds = build_splits(RoutedPackedDataset, RoutedPackedDatasetConfig(**kwargs), [12, 0, 0])[0]
    samples = [ds[i] for i in range(len(ds))]
    counts = [int(s[MISSING_ROWS_KEY]) for s in samples]
    assert counts == [int(missing_mask(s["routes"].numpy()).sum()) for s in samples]
    assert 0 in counts and max(counts) > 0  # packs with and without missing rows occurred
    clean = [s for s, c in zip(samples, counts, strict=True) if c == 0][:2]
    dirty = [s for s, c in zip(samples, counts, strict=True) if c > 0][:2]
    assert has_missing_routes(default_collate(clean)) is False
    assert has_missing_routes(default_collate(clean[:1] + dirty[:1])) is True
    assert has_missing_routes({"tokens": torch.zeros(1)}) is None
    on_device = default_collate(clean)
    on_device[MISSING_ROWS_KEY] = on_device[MISSING_ROWS_KEY].to("meta")
    with pytest.raises(ValueError, match="keep it on the host"):
        has_missing_routes(on_device)
    balanced = build_splits(
        RoutedPackedDataset,
        RoutedPackedDatasetConfig(**kwargs, route_missing_policy="balanced"),
        [12, 0, 0],
    )[0]
    assert all(int(balanced[i][MISSING_ROWS_KEY]) == 0 for i in range(len(balanced)))


def test_reading_a_pack_peaks_under_twice_its_routes(tmp_path):
    """What reading a pack's routes adds to a sample's peak memory (traced, with routes minus the
    same pack without them) stays within 2x the pack's routes: the gathered rows, the padded
    copy returned, and the host count of missing rows (validation is done at build)."""
    import tracemalloc

    from megatron_ext.data.indexed_writer import write_documents
    from megatron_ext.replay.route_dataset import (
        RoutedPackedDataset,
        RoutedPackedDatasetConfig,
        write_route_sidecar,
    )
    from tests.data.dataset_helpers import build_splits, gpt_config_kwargs

    layers, topk, experts, seq = 8, 8, 64, 1024
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 100, size=int(n)) for n in rng.integers(100, 700, size=12)]
    write_documents(str(tmp_path / "docs"), docs)
    routes = []
    for doc in docs:
        first = rng.integers(0, experts, size=(doc.size, layers, 1))
        r = ((first + np.arange(topk)) % experts).astype(np.uint8)  # distinct top-k
        r[-1] = 255
        routes.append(r)
    write_route_sidecar(
        str(tmp_path / "docs_routes"), routes, num_layers=layers, topk=topk, num_experts=experts
    )
    kwargs = gpt_config_kwargs(
        [str(tmp_path / "docs")], sequence_length=seq, path_to_cache=str(tmp_path / "cache")
    )
    kwargs.update(
        pad_to_seq_len=True, route_num_layers=layers, route_topk=topk, route_num_experts=experts
    )
    with_routes = build_splits(RoutedPackedDataset, RoutedPackedDatasetConfig(**kwargs), [4, 0, 0])
    kwargs["route_suffix"] = None
    without = build_splits(RoutedPackedDataset, RoutedPackedDatasetConfig(**kwargs), [4, 0, 0])
    tracemalloc.start()
    try:
        for i in range(3):
            peaks = []
            for ds in (with_routes[0], without[0]):
                tracemalloc.reset_peak()
                base = tracemalloc.get_traced_memory()[0]
                sample = ds[i]
                peaks.append(tracemalloc.get_traced_memory()[1] - base)
                del sample
            assert 1.0 <= (peaks[0] - peaks[1]) / (seq * layers * topk) <= 2.0, peaks
    finally:
        tracemalloc.stop()
